"""The policy YAML as typed models (contract section 2), and the resolved view the flow reads.

Files are parsed into the pydantic models below; `PolicySet` is the immutable result of one load.
A record is judged by exactly one PolicySet (one generation), never by a mix of two.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import cached_property
from types import MappingProxyType
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, StrictBool

from sidecar.durations import MAX_EPOCH_MS, format_duration_ms, parse_duration_ms
from sidecar.errors import ConfigError

SubscriptionType = Literal["shared", "key_shared", "exclusive", "failover"]
ByKey = Literal["none", "replace"]
"""`replace`: on the topic, a key's newest record replaces its pending one (policy/by_key.py)."""
# Subscriptions of these types keep inbound order and ignore delays, as in Pulsar (PIP-26).
ORDERED_TYPES: frozenset[str] = frozenset({"exclusive", "failover"})

DURATION_FORMS = "ms integer or 250ms, 30s, 5m, 2h, 7d"
# Kafka's own rule for topic names; checking it here turns a broker error at the first record into a
# policy error at load time, where the operator is looking.
_KAFKA_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")
KAFKA_NAME_FORMS = "1 to 249 of a-z, A-Z, 0-9, '.', '_', '-'"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_duration(value: object) -> object:
    """Milliseconds for a YAML duration value; ValueError says what was expected."""
    # bool is an int in Python: `max_delivery_delay: true` must not mean 1 ms.
    if isinstance(value, int) and not isinstance(value, bool):
        ms: int | None = value
        if value < 0:
            raise ValueError(f"expected a duration of zero or more ({DURATION_FORMS}), got {value}")
    elif isinstance(value, str):
        ms = parse_duration_ms(value.strip())
        if ms is None:
            raise ValueError(f"expected a duration ({DURATION_FORMS}), got {_show(value)}")
    else:
        raise ValueError(f"expected a duration ({DURATION_FORMS}), got {_show(value)}")
    # Nothing can be delivered after year 9999 (see MAX_EPOCH_MS), so a longer delay is a typo.
    if ms is not None and ms > MAX_EPOCH_MS:
        raise ValueError(f"expected a duration of at most {format_duration_ms(MAX_EPOCH_MS)}, got {_show(value)}")
    return ms


def _kafka_name(value: str) -> str:
    if not _KAFKA_NAME.fullmatch(value) or value in (".", ".."):
        raise ValueError(f"expected a Kafka topic name ({KAFKA_NAME_FORMS}), got {_show(value)}")
    return value


def _glob(value: str) -> str:
    if not value.strip():
        raise ValueError('expected a glob over topic names, like "payments.*", got an empty string')
    return value


DurationMs = Annotated[int, BeforeValidator(validate_duration)]
TopicName = Annotated[str, AfterValidator(_kafka_name)]
TopicGlob = Annotated[str, AfterValidator(_glob)]


class _Strict(BaseModel):
    # strict: YAML has real booleans and integers; accepting "yes" or 1 for `enabled` would hide typos.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class DelayedDeliveryPolicy(_Strict):
    """One level's settings; None means "inherit from the level above", 0 means "off at this level"."""

    enabled: StrictBool | None = None
    max_delivery_delay: DurationMs | None = None
    fixed_delivery_delay: DurationMs | None = None
    by_key: ByKey | None = None


class SubscriptionPolicy(_Strict):
    outbound: TopicName | None = None
    type: SubscriptionType = "shared"


class TopicPolicy(_Strict):
    delayed_delivery: DelayedDeliveryPolicy = DelayedDeliveryPolicy()
    dead_letter_topic: TopicName | None = None
    control_topic: TopicName | None = None
    """Where this topic's nack, cancel and reschedule commands must arrive (control/topics.py)."""
    subscriptions: dict[TopicName, SubscriptionPolicy | None] = {}


class NamespacePolicy(_Strict):
    topics: TopicGlob
    delayed_delivery: DelayedDeliveryPolicy = DelayedDeliveryPolicy()
    control_topic: TopicName | None = None


class DefaultsPolicy(_Strict):
    delayed_delivery: DelayedDeliveryPolicy = DelayedDeliveryPolicy()


class PolicyFile(_Strict):
    defaults: DefaultsPolicy | None = None
    namespaces: dict[str, NamespacePolicy] = {}
    topics: dict[TopicName, TopicPolicy | None] = {}
    allow_empty: bool = False
    """A policy with no topics is refused unless a file says this: an empty file is far more often a
    save caught half-way (truncate, then write) than an operator who means to stop every topic."""


BUILT_IN = DelayedDeliveryPolicy(enabled=True, max_delivery_delay=0, fixed_delivery_delay=0, by_key="none")
"""The level below defaults: what Pulsar does with an empty broker.conf (enabled, no limits)."""
DELAY_FIELDS = ("enabled", "max_delivery_delay", "fixed_delivery_delay", "by_key")


@dataclass(frozen=True)
class Sourced:
    """A value and the level it came from: 'topic', 'namespace:NAME', 'defaults' or 'built-in'."""

    value: int | bool | str
    source: str


@dataclass(frozen=True)
class EffectiveDelay:
    enabled: Sourced
    max_delivery_delay: Sourced
    fixed_delivery_delay: Sourced
    by_key: Sourced = Sourced("none", "built-in")

    @property
    def keyed(self) -> bool:
        """`by_key: replace`: the newest record per key replaces the pending one."""
        return self.by_key.value == "replace"

    @property
    def is_enabled(self) -> bool:
        return bool(self.enabled.value)

    @property
    def max_ms(self) -> int:
        return int(self.max_delivery_delay.value)

    @property
    def fixed_ms(self) -> int:
        return int(self.fixed_delivery_delay.value)

    def as_json(self) -> dict[str, dict[str, int | bool | str]]:
        return {
            name: {"value": sourced.value, "source": sourced.source}
            for name, sourced in (
                ("enabled", self.enabled),
                ("max_delivery_delay_ms", self.max_delivery_delay),
                ("fixed_delivery_delay_ms", self.fixed_delivery_delay),
                ("by_key", self.by_key),
            )
        }


def resolve_delay(levels: list[tuple[str, DelayedDeliveryPolicy]]) -> EffectiveDelay:
    """Each field from the most specific level that sets it; `levels` is ordered most specific first."""
    chain = [*levels, ("built-in", BUILT_IN)]

    def pick(name: str) -> Sourced:
        for source, policy in chain:
            value = getattr(policy, name)
            if value is not None:
                return Sourced(value, source)
        raise AssertionError("the built-in level sets every field")

    return EffectiveDelay(*(pick(name) for name in DELAY_FIELDS))


@dataclass(frozen=True)
class SubscriptionRoute:
    name: str
    outbound: str
    type: SubscriptionType

    @property
    def ordered(self) -> bool:
        """True for exclusive/failover: delivered at once and in inbound order, delay or not."""
        return self.type in ORDERED_TYPES


@dataclass(frozen=True)
class TopicRoute:
    topic: str
    namespace: str | None
    dead_letter_topic: str
    subscriptions: tuple[SubscriptionRoute, ...]
    delay: EffectiveDelay
    control_topic: str | None = None
    """The topic's own control topic (from the topic or its namespace); None: the sidecar's --control-topic."""

    def subscription(self, name: str) -> SubscriptionRoute | None:
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, SubscriptionRoute]:
        """Every command looks its subscription up (a nack three times): a dict, not a scan."""
        return {s.name: s for s in self.subscriptions}


@dataclass(frozen=True)
class PolicySet:
    """One generation of policies: every inbound topic with its routes and effective delay policy.

    The namespaces and defaults are kept as well so a topic that is not declared (an admin asking
    "what would apply to X?") can be resolved the same way as a declared one.
    """

    topics: Mapping[str, TopicRoute]
    generation: int = 1
    sources: tuple[str, ...] = field(default=())
    namespaces: Mapping[str, NamespacePolicy] = field(default_factory=lambda: MappingProxyType({}))
    defaults: DelayedDeliveryPolicy | None = None
    allow_empty: bool = False
    """Some file says `allow_empty: true`: no topics is what the operator means."""

    def route(self, topic: str) -> TopicRoute | None:
        return self.topics.get(topic)

    def namespace_of(self, topic: str) -> str | None:
        """The namespace whose glob matches `topic`; ConfigError when several do (ambiguous policy)."""
        matching = matching_namespaces(self.namespaces, topic)
        if len(matching) > 1:
            raise ConfigError(overlap_message(topic, matching, self.namespaces))
        return matching[0] if matching else None

    def delay_for(self, topic: str) -> EffectiveDelay:
        """The effective delay policy of any topic name, declared or not."""
        route = self.topics.get(topic)
        if route is not None:
            return route.delay
        namespace = self.namespace_of(topic)
        levels: list[tuple[str, DelayedDeliveryPolicy]] = []
        if namespace is not None:
            levels.append((f"namespace:{namespace}", self.namespaces[namespace].delayed_delivery))
        if self.defaults is not None:
            levels.append(("defaults", self.defaults))
        return resolve_delay(levels)


def matching_namespaces(namespaces: Mapping[str, NamespacePolicy], topic: str) -> list[str]:
    return sorted(name for name, ns in namespaces.items() if fnmatchcase(topic, ns.topics))


def overlap_message(topic: str, matching: list[str], namespaces: Mapping[str, NamespacePolicy]) -> str:
    globs = ", ".join(f'{name} ("{namespaces[name].topics}")' for name in matching)
    return (
        f"topic {topic} matches the globs of several namespaces: {globs}; "
        "make the globs disjoint so one namespace governs each topic"
    )
