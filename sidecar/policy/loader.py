"""Loading policy YAML from one file or a directory of files into one PolicySet.

Every error names the file, the key path and what was expected, because the person reading it
is an operator with an editor open, not a developer with a traceback. All problems of a load are
collected and raised together (PolicyError), so a `validate` run lists everything to fix at once.
"""

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, get_args

from pydantic import ValidationError
from ruamel.yaml import YAML

from sidecar.durations import format_duration_ms
from sidecar.policy.errors import PolicyError, Problem
from sidecar.policy.model import (
    BUILT_IN,
    DELAY_FIELDS,
    DURATION_FORMS,
    ByKey,
    DelayedDeliveryPolicy,
    NamespacePolicy,
    PolicyFile,
    PolicySet,
    SubscriptionPolicy,
    SubscriptionRoute,
    SubscriptionType,
    TopicPolicy,
    TopicRoute,
    matching_namespaces,
    overlap_message,
    resolve_delay,
)

log = logging.getLogger(__name__)

__all__ = [
    "BUILT_IN",
    "ParsedFile",
    "load_policies",
    "parse_policy_file",
    "parse_policy_text",
    "policy_files",
]

POLICY_SUFFIXES = (".yaml", ".yml")

_DELAY_KEYS = ", ".join(DELAY_FIELDS)
_ALLOWED_KEYS = {
    "file": "defaults, namespaces, topics, allow_empty",
    "defaults": "delayed_delivery",
    "delayed_delivery": _DELAY_KEYS,
    "namespace": "topics, delayed_delivery, control_topic",
    "topic": "delayed_delivery, dead_letter_topic, control_topic, subscriptions",
    "subscription": "outbound, type",
}


def policy_files(path: Path) -> list[Path]:
    """The files a policies path stands for: the file itself, or the directory's *.yaml / *.yml.

    Hidden files are skipped because editors keep their swap and backup copies there (`.x.yaml.swp`,
    `.#x.yaml`), and a half-saved copy must not be merged as a second definition of every topic.
    """
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.suffix in POLICY_SUFFIXES and not p.name.startswith(".") and p.is_file()
        )
        if not files:
            raise PolicyError([Problem(str(path), "", "no .yaml or .yml files in this policies directory")])
        return files
    if not path.exists():
        raise PolicyError([Problem(str(path), "", "policy file not found; pass --policies FILE_OR_DIR")])
    return [path]


@dataclass(frozen=True)
class ParsedFile:
    """One validated file, with its text kept to find line numbers for problems found later."""

    path: Path
    text: str
    policy: PolicyFile

    def problem(self, key: tuple[str | int, ...], expected: str) -> Problem:
        return Problem(str(self.path), _key_path(key), expected, _line_of(self.text, key))


def parse_policy_file(path: Path) -> ParsedFile:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise PolicyError([Problem(str(path), "", f"cannot read policy file: {e.strerror or e}")]) from e
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PolicyError(
            [Problem(str(path), "", f"expected UTF-8 text, got byte 0x{raw[e.start]:02x} at offset {e.start}")]
        ) from None
    return parse_policy_text(path, text)


def parse_policy_text(path: Path, text: str) -> ParsedFile:
    """Validate `text` as the content of `path` (the admin commands check an edit before writing it)."""
    try:
        data = YAML(typ="safe", pure=True).load(text)
    # The YAML library is third-party code fed operator input: beside YAMLError, some malformed
    # documents escape as ValueError, TypeError, RecursionError... None of them may crash a reload.
    except Exception as e:
        raise PolicyError([Problem(str(path), "", f"not valid YAML: {_one_line(str(e))}")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(
            [
                Problem(
                    str(path),
                    "",
                    f"expected a mapping with defaults, namespaces or topics at the top, got {_kind(data)}",
                )
            ]
        )
    try:
        policy = PolicyFile.model_validate(data)
    except ValidationError as e:
        problems = [
            Problem(str(path), _key_path(err["loc"]), _expected(err), _line_of(text, err["loc"])) for err in e.errors()
        ]
        raise PolicyError(sorted(problems, key=lambda p: p.line or 0)) from None
    return ParsedFile(path, text, policy)


EMPTY_POLICY = (
    "no topics: the sidecar would consume nothing and stop serving every topic. An empty or half-saved "
    "file is refused, and the policy in force stays; to run with no topics on purpose, add "
    "`allow_empty: true` at the top of a policy file"
)


def load_policies(
    path: Path,
    generation: int = 1,
    *,
    replace: Mapping[Path, str] | None = None,
    require_topics: bool = False,
) -> PolicySet:
    """Every file under `path` merged into one PolicySet; PolicyError lists every problem found.

    A topic, namespace or defaults section defined in two files is an error rather than "last one
    wins", because with several operators editing several files a silent override is how a
    7-day limit quietly becomes no limit.

    `replace` gives the text to use for some files instead of what is on disk, so an edit can be
    validated together with the other files before it is written.

    `require_topics` refuses a policy without topics unless a file says `allow_empty: true`: what
    the sidecar runs and `validate` checks. `show` and the editor leave it off, because a file of
    defaults alone is a fine thing to show or edit inside a directory of policies.
    """
    problems: list[Problem] = []
    parsed: list[ParsedFile] = []
    replaced = {p.resolve(): text for p, text in (replace or {}).items()}
    for file_path in policy_files(path):
        try:
            text = replaced.get(file_path.resolve())
            parsed.append(parse_policy_file(file_path) if text is None else parse_policy_text(file_path, text))
        except PolicyError as e:
            problems.extend(e.problems)

    defaults: DelayedDeliveryPolicy | None = None
    defaults_file: ParsedFile | None = None
    namespaces: dict[str, tuple[NamespacePolicy, ParsedFile]] = {}
    topics: dict[str, tuple[TopicPolicy, ParsedFile]] = {}
    for file in parsed:
        if file.policy.defaults is not None:
            if defaults_file is not None:
                problems.append(
                    file.problem(("defaults",), f"already defined in {defaults_file.path}; keep one defaults section")
                )
            else:
                defaults, defaults_file = file.policy.defaults.delayed_delivery, file
        for name, ns in file.policy.namespaces.items():
            if name in namespaces:
                problems.append(
                    file.problem(("namespaces", name), f"already defined in {namespaces[name][1].path}; keep one")
                )
            else:
                namespaces[name] = (ns, file)
        for name, topic in file.policy.topics.items():
            if name in topics:
                problems.append(file.problem(("topics", name), f"already defined in {topics[name][1].path}; keep one"))
            else:
                topics[name] = (topic or TopicPolicy(), file)

    namespace_policies = {name: ns for name, (ns, _) in namespaces.items()}
    routes: dict[str, TopicRoute] = {}
    for name, (topic, file) in topics.items():
        matching = matching_namespaces(namespace_policies, name)
        if len(matching) > 1:
            problems.append(file.problem(("topics", name), overlap_message(name, matching, namespace_policies)))
            continue
        namespace = matching[0] if matching else None
        levels: list[tuple[str, DelayedDeliveryPolicy]] = [("topic", topic.delayed_delivery)]
        if namespace is not None:
            levels.append((f"namespace:{namespace}", namespace_policies[namespace].delayed_delivery))
        if defaults is not None:
            levels.append(("defaults", defaults))
        routes[name] = TopicRoute(
            topic=name,
            namespace=namespace,
            dead_letter_topic=topic.dead_letter_topic or f"{name}.dlt",
            subscriptions=tuple(
                _route(name, sub, policy or SubscriptionPolicy()) for sub, policy in topic.subscriptions.items()
            ),
            delay=resolve_delay(levels),
            control_topic=topic.control_topic
            or (namespace_policies[namespace].control_topic if namespace is not None else None),
        )
    problems.extend(_crossed_topics(routes, topics))
    allow_empty = any(f.policy.allow_empty for f in parsed)
    if require_topics and not topics and not allow_empty and not problems:
        problems.append(Problem(str(path), "", EMPTY_POLICY))
    if problems:
        raise PolicyError(problems)
    log.debug("policies loaded path=%s generation=%d topics=%d", path, generation, len(routes))
    return PolicySet(
        topics=MappingProxyType(routes),
        generation=generation,
        sources=tuple(str(f.path) for f in parsed),
        namespaces=MappingProxyType(namespace_policies),
        defaults=defaults,
        allow_empty=allow_empty,
    )


def _route(topic: str, name: str, policy: SubscriptionPolicy) -> SubscriptionRoute:
    return SubscriptionRoute(name=name, outbound=policy.outbound or f"{topic}.{name}", type=policy.type)


def _crossed_topics(
    routes: Mapping[str, TopicRoute], topics: Mapping[str, tuple[TopicPolicy, ParsedFile]]
) -> list[Problem]:
    """Outbound and dead-letter topics that collide with inbound topics or with each other.

    An outbound topic that is also an inbound topic feeds the sidecar its own output forever, and two
    subscriptions sharing an outbound topic get each other's records; both are caught here, at load
    time, instead of being discovered in production.
    """
    problems: list[Problem] = []
    owners: dict[str, str] = {}
    for name, route in routes.items():
        file = topics[name][1]
        for sub in route.subscriptions:
            key: tuple[str, ...] = ("topics", name, "subscriptions", sub.name)
            explicit = topics[name][0].subscriptions.get(sub.name)
            shown = f"outbound topic {sub.outbound}" + ("" if explicit and explicit.outbound else " (the default)")
            if sub.outbound in routes:
                problems.append(
                    file.problem(key, f"{shown} is an inbound topic; the sidecar would consume its own output")
                )
            elif sub.outbound in owners:
                problems.append(
                    file.problem(
                        key,
                        f"{shown} is also the outbound topic of {owners[sub.outbound]}; give each subscription its own",
                    )
                )
            else:
                owners[sub.outbound] = ".".join(key)
    for name, route in routes.items():
        file = topics[name][1]
        explicit_dlt = topics[name][0].dead_letter_topic is not None
        shown = f"dead-letter topic {route.dead_letter_topic}" + ("" if explicit_dlt else " (the default)")
        key = ("topics", name, "dead_letter_topic") if explicit_dlt else ("topics", name)
        if route.dead_letter_topic in routes:
            problems.append(file.problem(key, f"{shown} is an inbound topic; rejected records would be consumed again"))
        elif route.dead_letter_topic in owners:
            problems.append(
                file.problem(
                    key,
                    f"{shown} is also the outbound topic of {owners[route.dead_letter_topic]}; "
                    "rejected records would reach that subscription",
                )
            )
    dead_letters = {route.dead_letter_topic: name for name, route in routes.items()}
    for name, route in routes.items():
        control = route.control_topic
        if control is None:
            continue
        file = topics[name][1]
        own = topics[name][0].control_topic is not None
        key = ("topics", name, "control_topic") if own else ("topics", name)
        shown = f"control topic {control}" + ("" if own else f" (from namespace {route.namespace})")
        # The control topic's own dead-letter and outcomes topics count too: none may be another's topic.
        for used in (control, f"{control}.dlt", f"{control}.outcomes"):
            clash = (
                "an inbound topic"
                if used in routes
                else f"the outbound topic of {owners[used]}"
                if used in owners
                else f"the dead-letter topic of {dead_letters[used]}"
                if used in dead_letters
                else None
            )
            if clash is not None:
                what = shown if used == control else f"{used}, which goes with {shown},"
                problems.append(file.problem(key, f"{what} is also {clash}; give the control topic a name of its own"))
                break
    return problems


def _key_path(loc: tuple[str | int, ...]) -> str:
    # pydantic marks a bad dict key with a trailing "[key]"; the path to the key itself says it better.
    return ".".join(str(part) for part in loc if part != "[key]")


def _kind(value: object) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _section(parent: tuple[str | int, ...]) -> str | None:
    """Which kind of mapping a key path points into, for "unknown key; expected one of ..."."""
    n = len(parent)
    if n == 0:
        return "file"
    if parent == ("defaults",):
        return "defaults"
    if parent[-1] == "delayed_delivery" and (
        (n == 2 and parent[0] == "defaults") or (n == 3 and parent[0] in ("namespaces", "topics"))
    ):
        return "delayed_delivery"
    if n == 2 and parent[0] == "namespaces":
        return "namespace"
    if n == 2 and parent[0] == "topics":
        return "topic"
    if n == 4 and parent[0] == "topics" and parent[2] == "subscriptions":
        return "subscription"
    return None


def _expected(err: Any) -> str:
    """What was expected at the key, in the operator's terms rather than pydantic's."""
    kind: str = err["type"]
    loc: tuple[str | int, ...] = err["loc"]
    got = _kind(err.get("input"))
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind == "extra_forbidden":
        section = _section(loc[:-1])
        allowed = f"; expected one of {_ALLOWED_KEYS[section]}" if section else ""
        return f"unknown key{allowed}"
    if kind == "missing":
        if loc[-1] == "topics" and len(loc) == 3:
            return 'required: a glob over topic names, like "payments.*"'
        return "required"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {got}"
    if kind == "string_type":
        topical = loc and loc[-1] in ("[key]", "outbound", "dead_letter_topic", "control_topic")
        what = "a Kafka topic name" if topical else "a string"
        return f"expected {what}, got {got}"
    if kind == "literal_error":
        choices = get_args(ByKey) if loc and loc[-1] == "by_key" else get_args(SubscriptionType)
        return f"expected one of {', '.join(choices)}, got {got}"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"expected a mapping, got {got}"
    if kind in ("int_type", "int_parsing"):
        return f"expected a duration ({DURATION_FORMS}), got {got}"
    return f"{err['msg']}, got {got}"


def _line_of(text: str, loc: tuple[str | int, ...]) -> int | None:
    """1-based line of the deepest key of `loc` found in the document, or None.

    Found with a second, round-trip parse (which keeps positions) only when there is a problem to
    report, so the normal load stays on the safe loader.
    """
    try:
        node: Any = YAML(typ="rt", pure=True).load(text)
    except Exception:  # best effort: a problem is still reported without its line
        return None
    line: int | None = None
    for part in loc:
        if part == "[key]":
            break
        if not hasattr(node, "lc") or not isinstance(node, dict) or part not in node:
            break
        try:
            line = int(getattr(node, "lc").key(part)[0]) + 1  # noqa: B009 - ruamel adds lc at runtime
        except Exception:
            break
        node = node[part]
    return line


def format_limit(ms: int) -> str:
    """A limit as an operator writes it (`7d`), or `0 (off)`."""
    return "0 (off)" if ms == 0 else format_duration_ms(ms)
