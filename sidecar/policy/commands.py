"""`delay-sidecar policies ...`: show, validate and edit policies (the pulsar-admin of this sidecar).

The pydantic-settings models at the bottom are mounted by sidecar/cli.py as the `policies`
subcommand; the functions above them do the work and are what the tests and the HTTP endpoint use.
An error reaches the operator as one clear message and exit code 2, never a traceback.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO, get_args

from pydantic import BaseModel, Field
from pydantic_settings import CliApp, CliPositionalArg, CliSubCommand, CliToggleFlag

from sidecar.durations import format_duration_ms
from sidecar.errors import ConfigError, SidecarError
from sidecar.policy.edit import Level, duration_value, set_delayed_delivery
from sidecar.policy.errors import PolicyError
from sidecar.policy.loader import load_policies
from sidecar.policy.model import ByKey, EffectiveDelay, PolicySet, Sourced

POLICIES_ENV = "DELAY_SIDECAR_POLICIES"
DEFAULT_POLICIES = Path("policies")
EXIT_INVALID = 1
"""`validate` found problems in the policies (the command itself worked)."""
EXIT_ERROR = 2
"""The command could not do its job: bad arguments, unreadable or invalid files, refused edit."""


def default_policies_path() -> Path:
    """`--policies` default, the same as `run` uses: DELAY_SIDECAR_POLICIES, else policies/."""
    return Path(os.environ.get(POLICIES_ENV) or DEFAULT_POLICIES)


# ------------------------------------------------------------------------------ show / GET /policies


def effective_policy_json(policy_set: PolicySet, topic: str) -> dict[str, Any]:
    """The effective policy of `topic` with the level each value came from (GET /policies/{topic}).

    A topic that is not declared under `topics:` is still resolved through its namespace glob and
    the defaults, because an operator asks "what would apply to X?" before declaring X; `declared`
    is then false and it has no subscriptions or dead-letter topic, since the sidecar does not
    consume it. Raises ConfigError when the topic matches several namespace globs.
    """
    route = policy_set.route(topic)
    namespace = route.namespace if route is not None else policy_set.namespace_of(topic)
    delay = route.delay if route is not None else policy_set.delay_for(topic)
    return {
        "topic": topic,
        "declared": route is not None,
        "namespace": namespace,
        "generation": policy_set.generation,
        "delayed_delivery": delay.as_json(),
        "dead_letter_topic": route.dead_letter_topic if route is not None else None,
        "control_topic": route.control_topic if route is not None else None,
        "subscriptions": [
            {"name": s.name, "outbound": s.outbound, "type": s.type, "ordered": s.ordered}
            for s in (route.subscriptions if route is not None else ())
        ],
    }


def _shown(name: str, sourced: Sourced) -> str:
    if name == "enabled":
        return "true" if sourced.value else "false"
    if name == "by_key":
        return str(sourced.value)
    ms = int(sourced.value)
    return "0 (off)" if ms == 0 else f"{format_duration_ms(ms)} ({ms} ms)"


def format_effective_policy(policy_set: PolicySet, topic: str) -> str:
    """`effective_policy_json` as a table for a person: value and the level it came from."""
    info = effective_policy_json(policy_set, topic)
    route = policy_set.route(topic)
    delay: EffectiveDelay = route.delay if route is not None else policy_set.delay_for(topic)
    lines = [f"topic {topic}"]
    if not info["declared"]:
        lines.append("  not declared under topics: the sidecar does not consume it; this is what would apply")
    lines.append(f"  namespace: {info['namespace'] or '-'}")
    lines.append(f"  policies generation {policy_set.generation} from {', '.join(policy_set.sources) or '-'}")
    rows = [
        ("setting", "value", "from"),
        ("enabled", _shown("enabled", delay.enabled), delay.enabled.source),
        ("max_delivery_delay", _shown("max", delay.max_delivery_delay), delay.max_delivery_delay.source),
        (
            "fixed_delivery_delay",
            _shown("fixed", delay.fixed_delivery_delay),
            delay.fixed_delivery_delay.source,
        ),
        ("by_key", _shown("by_key", delay.by_key), delay.by_key.source),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines += [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    if route is not None:
        lines.append(f"  dead_letter_topic: {route.dead_letter_topic}")
        control = route.control_topic or "the sidecar's --control-topic"
        lines.append(f"  control_topic: {control}")
        lines.append("  subscriptions:" if route.subscriptions else "  subscriptions: none")
        for s in route.subscriptions:
            note = "  (ignores delays, inbound order)" if s.ordered else ""
            lines.append(f"    {s.name}: {s.type} -> {s.outbound}{note}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ validate


def validate_paths(paths: list[Path], out: TextIO, err: TextIO) -> int:
    """Load each path on its own; an "ok" line per good one, a line per problem of the others."""
    status = 0
    for path in paths:
        try:
            policy_set = load_policies(path, require_topics=True)
        except PolicyError as e:
            status = EXIT_INVALID
            for problem in e.problems:
                print(problem, file=err)
        except ConfigError as e:
            status = EXIT_INVALID
            print(f"{path}: {e}", file=err)
        else:
            print(
                f"ok {path}: {len(policy_set.topics)} topics, {len(policy_set.namespaces)} namespaces, "
                f"defaults {'set' if policy_set.defaults is not None else 'not set'}",
                file=out,
            )
    return status


# ------------------------------------------------------------------------------ CLI models


def _fail(e: SidecarError) -> None:
    problems = e.problems if isinstance(e, PolicyError) else ()
    for line in [str(p) for p in problems] or [str(e)]:
        print(f"error: {line}", file=sys.stderr)
    raise SystemExit(EXIT_ERROR)


_POLICIES_HELP = f"policy file or directory (env {POLICIES_ENV}, default {DEFAULT_POLICIES}/)"


class ShowCommand(BaseModel):
    """Print the effective delayed-delivery policy of a topic and the level each value came from."""

    topic: CliPositionalArg[str] = Field(description="inbound topic name (declared or not)")
    policies: Path = Field(default_factory=default_policies_path, description=_POLICIES_HELP)
    json_output: CliToggleFlag[bool] = Field(False, alias="json", description="print JSON, as GET /policies/{topic}")

    def cli_cmd(self) -> None:
        try:
            policy_set = load_policies(self.policies)
            if self.json_output:
                print(json.dumps(effective_policy_json(policy_set, self.topic), indent=2))
            else:
                print(format_effective_policy(policy_set, self.topic))
        except SidecarError as e:
            _fail(e)


class ValidateCommand(BaseModel):
    """Check policy files or directories; exit 1 and print one line per problem if any is invalid."""

    paths: CliPositionalArg[list[Path]] = Field(description="policy files or directories")

    def cli_cmd(self) -> None:
        status = validate_paths(self.paths, sys.stdout, sys.stderr)
        if status:
            raise SystemExit(status)


class SetDelayedDeliveryCommand(BaseModel):
    """Set delayed-delivery values of a topic, a namespace or the defaults in a policy file.

    Comments and key order are kept; the file is validated before it is written and written
    atomically. 0 disables a limit at that level (it does not inherit).
    """

    topic: str = Field("", description="set it for this topic")
    namespace: str = Field("", description="set it for this namespace (already in the file)")
    defaults: CliToggleFlag[bool] = Field(False, description="set the sidecar-wide defaults")
    max_delay: str = Field("", description="max delivery delay: ms or 250ms, 30s, 5m, 2h, 7d; 0 = no limit")
    fixed_delay: str = Field("", description="fixed delivery delay, overriding producers; 0 = off")
    enable: CliToggleFlag[bool] = Field(False, description="enable delayed delivery")
    disable: CliToggleFlag[bool] = Field(False, description="disable delayed delivery (deliver at once)")
    by_key: str = Field(
        "", description="replace: a key's newest record replaces its pending one, a tombstone cancels it; none: off"
    )
    file: str = Field("", description="the policy file to edit (required)")
    policies: Path = Field(
        default_factory=default_policies_path,
        description=f"{_POLICIES_HELP}; when the file is in it, the edit is checked against the whole set",
    )

    def level(self) -> Level:
        """Checked here rather than in a model validator, so a wrong combination is a usage message."""
        chosen = sum((bool(self.topic), bool(self.namespace), self.defaults))
        if chosen != 1:
            raise ConfigError("give exactly one of --topic, --namespace or --defaults")
        if self.topic:
            return Level("topic", self.topic)
        if self.namespace:
            return Level("namespace", self.namespace)
        return Level("defaults")

    def values(self) -> dict[str, int | str | bool]:
        if self.enable and self.disable:
            raise ConfigError("give --enable or --disable, not both")
        values: dict[str, int | str | bool] = {}
        if self.max_delay:
            values["max_delivery_delay"] = duration_value("--max-delay", self.max_delay)
        if self.fixed_delay:
            values["fixed_delivery_delay"] = duration_value("--fixed-delay", self.fixed_delay)
        if self.enable or self.disable:
            values["enabled"] = self.enable
        if self.by_key:
            if self.by_key not in get_args(ByKey):
                raise ConfigError(f"--by-key takes {' or '.join(get_args(ByKey))}, not {self.by_key!r}")
            values["by_key"] = self.by_key
        return values

    def cli_cmd(self) -> None:
        try:
            if not self.file:
                raise ConfigError("give --file FILE, the policy file to edit")
            level = self.level()
            set_delayed_delivery(Path(self.file), level, self.values(), self.policies)
            print(f"updated {self.file}: {level}")
        except SidecarError as e:
            _fail(e)


class PoliciesCommand(BaseModel):
    """Show, validate and edit delayed-delivery policies."""

    show: CliSubCommand[ShowCommand] = Field(description="effective policy of a topic, with where each value came from")
    validate_: CliSubCommand[ValidateCommand] = Field(
        alias="validate", description="check policy files; one line per problem"
    )
    set_delayed_delivery: CliSubCommand[SetDelayedDeliveryCommand] = Field(
        description="edit a policy file in place, keeping comments"
    )

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
