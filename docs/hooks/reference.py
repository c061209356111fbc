"""MkDocs hook: the reference pages take their lists from the code when the site is built.

A hand-kept list of flags, metrics or error codes drifts from the code the day someone adds one,
and a reader cannot tell. So the pages hold the prose, and a marker where the list goes:

- `<!-- generated: cli -->`: the `--help` of every command, from the parser `delay-sidecar` builds;
- `<!-- generated: metrics -->`: every metric the sidecar and the supervisor register, with its type,
  labels, help text and histogram buckets;
- `<!-- generated: endpoints -->` and `<!-- generated: health -->`: the paths the metrics port
  answers, and the reasons and details `/healthz` can give, read from the code that sets them;
- `<!-- generated: error-codes -->`: every error code the code defines, where it is defined, what
  docs/contract.md says it means, and what to do about it.

A code, metric or reason the pages cannot explain stops the build (mkdocs build --strict runs in
./scripts/test.sh), so the site cannot silently fall behind.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, get_args

from mkdocs.exceptions import PluginError
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from pydantic import BaseModel
from pydantic_settings import BaseSettings, CliSettingsSource, CliSubCommand

from sidecar.cli import DelaySidecar
from sidecar.cli_help import add_argument
from sidecar.metrics import Metrics
from sidecar.settings import ENV_PREFIX
from sidecar.supervisor import SupervisorMetrics

ROOT = Path(__file__).resolve().parents[2]
SIDECAR = ROOT / "sidecar"
CONTRACT = ROOT / "docs" / "contract.md"
HELP_COLUMNS = "100"


# ---------------------------------------------------------------------------------------------------
# The command line


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command, groups included, in the order `--help` lists them, from the real parser."""
    source: Any = CliSettingsSource(DelaySidecar, add_argument_method=add_argument)

    def walk(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        yield name, parser
        for child, sub in _subparsers(parser).items():
            yield from walk(f"{name} {child}", sub)

    yield from walk("delay-sidecar", source.root_parser)


def _models() -> dict[str, Any]:
    """Command name -> the settings model its flags come from (leaf commands only)."""
    marker = get_args(CliSubCommand)[1]
    leaves: dict[str, Any] = {}
    pending: list[tuple[str, Any]] = [("delay-sidecar", DelaySidecar)]
    while pending:
        prefix, model = pending.pop()
        children = [
            (f"{prefix} {(info.alias or name).replace('_', '-')}", sub)
            for name, info in model.model_fields.items()
            if marker in info.metadata
            for sub in get_args(info.annotation)
            if isinstance(sub, type) and issubclass(sub, BaseModel)
        ]
        pending += children
        if not children:
            leaves[prefix] = model
    return leaves


def _variables(model: Any, parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(--flag, DELAY_SIDECAR_*) for a command whose settings read the environment, in --help order."""
    if not (issubclass(model, BaseSettings) and model.model_config.get("env_prefix") == ENV_PREFIX):
        return []
    fields = {name for name, info in model.model_fields.items() if info.alias is None}
    found: list[tuple[str, str]] = []
    for action in parser._actions:
        field = action.dest.rsplit(".", 1)[-1]
        longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if field in fields and longs:
            found.append((longs[0], ENV_PREFIX + field.upper()))
    return found


def _help(parser: argparse.ArgumentParser) -> str:
    """What `--help` prints, at a fixed width so the page does not depend on the builder's terminal."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            parser.print_help()
        return out.getvalue().rstrip()
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


@cache
def cli_markdown() -> str:
    models = _models()
    parts: list[str] = []
    for name, parser in _parsers():
        parts.append(f"## `{name}`\n\n```text\n$ {name} --help\n{_help(parser)}\n```\n")
        variables = _variables(models[name], parser) if name in models else []
        if variables:
            rows = "\n".join(f"| `{flag}` | `{variable}` |" for flag, variable in variables)
            parts.append(f"| flag | environment variable |\n| --- | --- |\n{rows}\n")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------
# Metrics


@cache
def metrics_markdown() -> str:
    owners = [("the sidecar (each worker)", Metrics(CollectorRegistry())), ("the supervisor", SupervisorMetrics())]
    parts: list[str] = []
    for who, owner in owners:
        rows: list[str] = []
        buckets: list[str] = []
        for wrapper in vars(owner).values():
            if not isinstance(wrapper, MetricWrapperBase):
                continue
            for family in wrapper.describe():
                name = family.name + "_total" if family.type == "counter" else family.name
                labels = ", ".join(f"`{label}`" for label in wrapper._labelnames) or "none"
                rows.append(f"| `{name}` | {family.type} | {labels} | {_cell(family.documentation)} |")
                bounds = getattr(wrapper, "_upper_bounds", None)
                if family.type == "histogram" and bounds:
                    shown = ", ".join(_seconds(b) for b in bounds if b != float("inf"))
                    buckets.append(f"- `{name}`: {shown}")
        parts.append(f"### Registered by {who}\n\n| metric | type | labels | help |\n| --- | --- | --- | --- |\n")
        parts[-1] += "\n".join(rows) + "\n"
        if buckets:
            parts.append("Histogram buckets (upper bounds, in seconds):\n\n" + "\n".join(buckets) + "\n")
    return "\n".join(parts)


def _seconds(bound: float) -> str:
    return f"{bound:g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------------
# The HTTP endpoints and /healthz


def _tree(relative: str) -> ast.Module:
    path = SIDECAR / relative
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise PluginError(f"docs/hooks/reference.py: no function {name} in the code any more; update the hook")


def _text(node: ast.expr) -> str | None:
    """A string constant or f-string as a reader sees it, each placeholder shown as `…`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    return None


@cache
def endpoints_markdown() -> str:
    handle = _function(_tree("http.py"), "_handle")
    paths: list[str] = []
    for node in ast.walk(handle):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "path":
            paths += [c.value for c in node.comparators if isinstance(c, ast.Constant)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            paths += [a.value for a in node.args if isinstance(a, ast.Constant)]
    shown = {"/policies/": "/policies/{topic}", "/messages/": "/messages/{topic}/{partition}/{offset}"}
    seen = list(dict.fromkeys(shown.get(p, p) for p in paths))
    if not seen:
        raise PluginError("docs/hooks/reference.py found no paths in sidecar/http.py's _handle")
    return "\n".join(f"- `GET {p}`" for p in seen) + "\n"


# Where /healthz's reasons and details are set: (file, function or None for the whole module).
HEALTH_SOURCES = (
    ("engine.py", None),
    ("app.py", None),
    ("kafka_io.py", None),
    ("supervisor.py", "_health"),
)
# The attributes whose text becomes a reason.
REASON_ATTRIBUTES = frozenset({"_state", "reason", "_recovering"})


def _reasons(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                targets = target.elts if isinstance(target, ast.Tuple) else [target]
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for t, v in zip(targets, values, strict=False):
                    text = _text(v)
                    if isinstance(t, ast.Attribute) and t.attr in REASON_ATTRIBUTES and text:
                        yield text
                    if isinstance(t, ast.Name) and t.id == "reasons":
                        yield from _listed(v)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "append"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "reasons"
        ):
            yield from (t for a in node.args if (t := _text(a)))
        elif (
            isinstance(node, ast.BoolOp)
            and isinstance(node.values[0], ast.Attribute)
            and node.values[0].attr in REASON_ATTRIBUTES
        ):  # `self._recovering or "starting"`
            yield from (t for v in node.values[1:] if (t := _text(v)))


def _listed(value: ast.expr) -> Iterator[str]:
    """The texts of `reasons = [...]`, or of either branch of `[...] if ... else [...]`."""
    if isinstance(value, ast.IfExp):
        yield from _listed(value.body)
        yield from _listed(value.orelse)
    elif isinstance(value, ast.List):
        yield from (t for item in value.elts if (t := _text(item)))


def _details(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "details"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.ctx, ast.Store)
        ):
            yield node.slice.value
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 3:
            last = node.value.elts[2]
            if isinstance(last, ast.Dict):
                yield from (k.value for k in last.keys if isinstance(k, ast.Constant))


@cache
def health_markdown() -> str:
    reasons: dict[str, set[str]] = {}
    details: dict[str, set[str]] = {}
    for relative, function in HEALTH_SOURCES:
        tree: ast.AST = _tree(relative)
        if function is not None:
            tree = _function(tree, function)
        where = f"sidecar/{relative}"
        for reason in _reasons(tree):
            reasons.setdefault(reason, set()).add(where)
        for key in _details(tree):
            details.setdefault(key, set()).add(where)
    if "starting" not in reasons or "policy_generation" not in details:
        raise PluginError("docs/hooks/reference.py no longer finds /healthz's reasons in the code; update the hook")
    reason_rows = "\n".join(
        f"| `{reason}` | {', '.join(f'`{w}`' for w in sorted(where))} |" for reason, where in sorted(reasons.items())
    )
    detail_rows = "\n".join(
        f"| `{key}` | {', '.join(f'`{w}`' for w in sorted(where))} |" for key, where in sorted(details.items())
    )
    return (
        "Reasons (`…` stands for the part filled in at run time):\n\n"
        f"| reason | set in |\n| --- | --- |\n{reason_rows}\n\n"
        f"Keys of `details`:\n\n| key | set in |\n| --- | --- |\n{detail_rows}\n"
    )


# ---------------------------------------------------------------------------------------------------
# Error codes

_CODE = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
_HEADING = re.compile(r"^## (\d+)\. ", re.MULTILINE)
_ANY_H2 = re.compile(r"^## ", re.MULTILINE)
_SPAN = re.compile(r"`([^`]+)`")
CANCEL_HEADING = "### Cancel and reschedule"

# What to do about each code: the one thing the contract's tables do not say. A code added to the
# code without a line here stops the build, so the page answers every code a reader can meet.
REMEDIES: dict[str, str] = {
    "INVALID_DELAY_HEADER": "Fix the producer: one header, `deliver-at` (epoch ms or RFC 3339 with an offset) "
    "or `deliver-after` (ms, or digits with `ms`, `s`, `m`, `h`, `d`), ASCII. `sidecar.client.delay_headers` "
    "raises in the producer instead. `delay-error-message` says what was wrong with the value.",
    "EXCEEDS_MAX_DELAY": "The delay asked for is longer than the topic's `max_delivery_delay`; the message names "
    "the limit and the level (topic, namespace or defaults) that set it. The record was not delivered to any "
    "subscription: it is on the dead-letter topic, unchanged. Ask for less and produce it again to the inbound "
    "topic, or raise the limit at that level (`delay-sidecar policies set-delayed-delivery ... --max-delay`). "
    "A refused nack schedules no redelivery, and a refused reschedule leaves the message on its schedule; for "
    "both, the delay counts from the command record's timestamp.",
    "EXCEEDS_RETENTION": "The record would be deleted by the inbound topic's `retention.ms` before it falls due. "
    "Raise the topic's retention above the longest delay you accept, or set a `max_delivery_delay` below it so "
    "that producers are refused with a clearer code.",
    "TOPIC_REMOVED": "The topic left the policies while this record waited. If that was a mistake, put the topic "
    "back: records not dead-lettered yet are delivered when due. Records already on the dead-letter topic can be "
    "produced to the inbound topic again.",
    "INVALID_COMMAND": "The control record is not a version-1 command of a known type, or a field is missing or "
    "of the wrong type; `delay-error-message` (or the outcome's `message`) names it. `sidecar.client.Nacker` and "
    "`sidecar.client_cancel.Canceller` write valid commands.",
    "UNKNOWN_SUBSCRIPTION": "The command names a subscription the policies in force do not have for that topic "
    "(or no longer have, when a nack falls due). Check the spelling against `delay-sidecar policies show TOPIC`.",
    "UNKNOWN_MESSAGE": "A nack named a message the subscription has not received yet (still delayed, not read "
    "yet), one past the partition's end, one retention deleted, or one that was dead-lettered. Nack only what "
    "you consumed, with the ids from its `delay-origin` header.",
    "UNKNOWN_TOPIC": "The cancel or reschedule names a topic the policies in force do not serve.",
    "NOT_DELAYED": "The subscription is `exclusive` or `failover`: it got the message at once, so there is "
    "nothing to cancel or move for it. Name a `shared` or `key_shared` subscription, or none.",
    "DELAYS_DISABLED": "The topic's delayed delivery is disabled (`enabled: false`), so a reschedule has nothing "
    "to move. Enable delays for the topic, or send a cancel instead.",
    "FIXED_DELAY_TOPIC": "The topic has a fixed delivery delay: producers cannot choose the time, so neither can "
    "a reschedule. Cancel and produce again if the time must change.",
    "DEAD_LETTERED": "The message went to the dead-letter topic when it was read and was never owed to a "
    "subscription; its `delay-error-code` there says why.",
    "ALREADY_CANCELLED": "A reschedule arrived after a cancel of the same message. Produce the message again if it "
    "should go out after all.",
    "WRONG_CONTROL_TOPIC": "The topic has a control topic of its own (`control_topic` in the policies) and the "
    "command came on another. Send it there: `Nacker`, `Canceller` and `OutcomeReader` take `control_topic=`. "
    "`delay-sidecar policies show TOPIC` prints the one in force.",
    "NOT_KEYED": "A command named its message by key, but the topic's records are not kept by key. Name the "
    "message by `partition` and `offset` (the producer's delivery report), or set `by_key: replace` for the "
    "topic if the newest record per key should replace the pending one.",
}


def _defined_codes() -> dict[str, list[str]]:
    """Code -> `file:line` of each definition: a module constant whose value is its own name, or the
    literal a RejectedRecord subclass passes up."""
    found: dict[str, list[str]] = {}
    for path in sorted(SIDECAR.rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                value = node.value.value
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if isinstance(value, str) and _CODE.fullmatch(value) and value in names:
                    found.setdefault(value, []).append(f"{where}:{node.lineno}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__init__"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and _CODE.fullmatch(node.args[0].value)
            ):
                found.setdefault(node.args[0].value, []).append(f"{where}:{node.lineno}")
    return found


def _contract_sections() -> dict[int, str]:
    doc = CONTRACT.read_text(encoding="utf-8")
    found: dict[int, str] = {}
    for match in _HEADING.finditer(doc):
        following = _ANY_H2.search(doc, match.end())
        found[int(match.group(1))] = doc[match.start() : following.start() if following else len(doc)]
    return found


def _rows(text: str) -> Iterator[list[str]]:
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            yield [cell.strip() for cell in line.strip().strip("|").split("|")]


def _meanings() -> dict[str, list[tuple[str, str]]]:
    """Code -> (where it goes, what docs/contract.md says it means), from the contract's tables."""
    sections = _contract_sections()
    found: dict[str, list[tuple[str, str]]] = {}
    for cells in _rows(sections[3]):
        if len(cells) == 3 and (codes := [s for s in _SPAN.findall(cells[0]) if _CODE.fullmatch(s)]):
            place = "the topic's dead-letter topic" if cells[1] == "topic's" else "the control dead-letter topic"
            for code in codes:
                found.setdefault(code, []).append((place + " (section 3)", cells[2]))
    nacks, cancels = sections[5].split(CANCEL_HEADING)
    for text, place in ((nacks, "a nack on the control dead-letter topic (section 5)"),
                        (cancels, "a `rejected` outcome of a cancel or reschedule (section 5)")):  # fmt: skip
        for cells in _rows(text):
            if len(cells) == 2 and (codes := [s for s in _SPAN.findall(cells[0]) if _CODE.fullmatch(s)]):
                for code in codes:
                    found.setdefault(code, []).append((place, cells[1]))
    return found


@cache
def errors_markdown() -> str:
    defined, meanings = _defined_codes(), _meanings()
    problems = [
        f"{c} is defined in the code but docs/contract.md explains it nowhere" for c in defined if c not in meanings
    ]
    problems += [f"{c} has no entry in REMEDIES (docs/hooks/reference.py)" for c in defined if c not in REMEDIES]
    problems += [f"REMEDIES explains {c}, which the code no longer defines" for c in REMEDIES if c not in defined]
    if problems:
        raise PluginError("error codes: " + "; ".join(problems))
    parts = ["| code | where you meet it |\n| --- | --- |"]
    for code in sorted(defined):
        places = "; ".join(dict.fromkeys(place for place, _ in meanings[code]))
        parts.append(f"| [`{code}`](#{code.lower()}) | {places} |")
    parts.append("")
    for code in sorted(defined):
        parts.append(f"### `{code}` {{ #{code.lower()} }}\n")
        for place, meaning in meanings[code]:
            parts.append(f"- **On {place}:** {meaning}")
        parts.append(f"- **What to do:** {REMEDIES[code]}")
        parts.append(f"- **Defined in:** {', '.join(f'`{w}`' for w in defined[code])}\n")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------
# The hook

MARKERS: dict[str, Callable[[], str]] = {
    "<!-- generated: cli -->": cli_markdown,
    "<!-- generated: metrics -->": metrics_markdown,
    "<!-- generated: endpoints -->": endpoints_markdown,
    "<!-- generated: health -->": health_markdown,
    "<!-- generated: error-codes -->": errors_markdown,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
