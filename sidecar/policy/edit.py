"""In-place edits of a policy file that an operator also edits by hand (`set-delayed-delivery`).

Round-trip mode keeps comments, key order, quoting and indentation, so the diff of an edit is the
edited line and nothing else; the result is validated before it is written, and written by
rename, so the watcher (or a crash) never sees a half-written or invalid file.
"""

import io
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.tokens import CommentToken
from ruamel.yaml.util import load_yaml_guess_indent

from sidecar.policy.errors import PolicyError, Problem
from sidecar.policy.loader import load_policies, parse_policy_text
from sidecar.policy.model import DELAY_FIELDS, PolicySet, validate_duration

log = logging.getLogger(__name__)

LevelKind = Literal["topic", "namespace", "defaults"]


@dataclass(frozen=True)
class Level:
    """Where a setting goes: a topic, a namespace, or the defaults (name None)."""

    kind: LevelKind
    name: str | None = None

    def key_path(self) -> tuple[str, ...]:
        if self.kind == "defaults":
            return ("defaults", "delayed_delivery")
        assert self.name is not None
        return ("topics" if self.kind == "topic" else "namespaces", self.name, "delayed_delivery")

    def __str__(self) -> str:
        return "defaults" if self.kind == "defaults" else f"{self.kind} {self.name}"


def duration_value(option: str, text: str) -> int | str:
    """A duration as the operator typed it, checked now so the error names the option, not a key."""
    try:
        validate_duration(text)
    except ValueError as e:
        raise PolicyError([Problem(option, "", str(e))]) from None
    stripped = text.strip()
    # A plain number is written as a YAML integer (milliseconds), anything else as typed ("30m").
    return int(stripped) if stripped.isdigit() else stripped


def edit_delayed_delivery(text: str, file: Path, level: Level, values: dict[str, int | str | bool]) -> str:
    """`text` with `values` set under `level`'s delayed_delivery; PolicyError if the result is invalid."""
    if not values:
        raise PolicyError(
            [Problem(str(file), "", "nothing to set: give --max-delay, --fixed-delay, --enable, --disable or --by-key")]
        )
    unknown = set(values) - set(DELAY_FIELDS)
    if unknown:
        raise ValueError(f"not delayed_delivery fields: {sorted(unknown)}")
    yaml = _round_trip_yaml(text)
    try:
        doc: Any = yaml.load(text)
    except Exception as e:
        raise PolicyError([Problem(str(file), "", f"not valid YAML: {' '.join(str(e).split())}")]) from None
    if doc is None:
        doc = CommentedMap()
    if not isinstance(doc, CommentedMap):
        raise PolicyError([Problem(str(file), "", "expected a mapping with defaults, namespaces or topics at the top")])

    if level.kind == "namespace":
        namespaces = doc.get("namespaces")
        if not isinstance(namespaces, dict) or level.name not in namespaces:
            raise PolicyError(
                [
                    Problem(
                        str(file),
                        f"namespaces.{level.name}",
                        "not defined in this file; add the namespace with its topics glob first",
                    )
                ]
            )
    node = doc
    path = level.key_path()
    for depth, key in enumerate(path):
        node = _child_map(node, key, file, ".".join(path[: depth + 1]))
    for i, name in enumerate(DELAY_FIELDS):
        if name not in values:
            continue
        if name in node:
            node[name] = values[name]
            continue
        # A new field goes before the first present field that comes after it in the usual order.
        later = [list(node).index(f) for f in DELAY_FIELDS[i + 1 :] if f in node]
        if later:
            node.insert(min(later), name, values[name])
        else:
            _insert(node, name, values[name])

    out = io.StringIO()
    yaml.dump(doc, out)
    new_text = out.getvalue()
    parse_policy_text(file, new_text)  # raises PolicyError with file, line and key
    return new_text


def set_delayed_delivery(
    file: Path, level: Level, values: dict[str, int | str | bool], policies: Path | None = None
) -> PolicySet:
    """Edit `file` in place; when it is part of the `policies` path, check it together with the rest.

    Nothing is written unless the whole policy set is valid after the edit: an invalid file in a
    watched directory would be rejected by the running sidecar anyway, but it would also break the
    next start.
    """
    if not file.is_file():
        raise PolicyError([Problem(str(file), "", "policy file not found; create it (an empty file will do) first")])
    target = file.resolve()  # a symlinked file is edited where it lives, not replaced by a copy
    try:
        text = target.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError([Problem(str(file), "", f"cannot read policy file: {e}")]) from None
    new_text = edit_delayed_delivery(text, file, level, values)
    check = file
    if policies is not None and policies.is_dir() and target.parent == policies.resolve():
        check = policies
    result = load_policies(check, replace={target: new_text})
    atomic_write(target, new_text)
    log.info("policy file edited file=%s level=%s values=%s", file, level, values)
    return result


def atomic_write(path: Path, text: str) -> None:
    """Write by temp file + rename in the same directory, keeping the file's permissions.

    The temp name starts with "." so a watcher of the directory never loads it as a policy file.
    """
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _round_trip_yaml(text: str) -> YAML:
    yaml = YAML(typ="rt", pure=True)
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap an operator's long lines
    try:
        _, indent, block_seq_indent = load_yaml_guess_indent(text)
    except Exception:
        indent, block_seq_indent = None, None
    indent = indent or 2
    yaml.indent(mapping=indent, sequence=indent + (block_seq_indent or 0), offset=block_seq_indent or 0)
    return yaml


def _child_map(node: CommentedMap, key: str, file: Path, key_path: str) -> CommentedMap:
    child = node.get(key)
    if isinstance(child, CommentedMap):
        if not len(child):
            child.fa.set_block_style()  # `billing: {}` grows into a block, not `{a: {b: 1}}`
        return child
    if child is not None:
        raise PolicyError([Problem(str(file), key_path, f"expected a mapping, got {child!r}")])
    new = CommentedMap()
    new.fa.set_block_style()
    if key in node:
        node[key] = new
    else:
        _insert(node, key, new)
    return new


def _insert(node: CommentedMap, key: str, value: Any) -> None:
    """Add `key` after the existing keys, keeping blank lines and comments that followed the last one.

    ruamel attaches what follows a mapping's last value (the blank line and comments before the next
    section) to that value; appending naively would put the new key after them, detached from its
    section. So the trailing part moves to the new key.
    """
    slot = _last_slot(node)
    node[key] = value
    if slot is None:
        return
    owner, last = slot
    token = owner.ca.items.get(last, [None, None, None, None])[2]
    if not isinstance(token, CommentToken):
        return
    head, sep, rest = token.value.partition("\n")
    if not sep or not rest:
        return
    if head.strip():
        token.value = head + "\n"
    else:
        owner.ca.items[last][2] = None
    new_slot = _last_slot(node)
    if new_slot is None:
        return
    new_owner, new_last = new_slot
    moved = CommentToken("\n" + rest, token.start_mark, None)
    new_owner.ca.items.setdefault(new_last, [None, None, None, None])[2] = moved


def _last_slot(node: CommentedMap) -> tuple[CommentedMap, Any] | None:
    """The mapping and key holding whatever follows the last line of `node`'s block."""
    while len(node):
        last = next(reversed(node))
        child = node[last]
        if isinstance(child, CommentedMap) and len(child) and not child.fa.flow_style():
            node = child
            continue
        return node, last
    return None
