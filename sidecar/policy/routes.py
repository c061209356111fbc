"""Where a topic's records go, and the rule that decided a record's fate when it first arrived.

`Routes` is today's view: which subscriptions a topic has, and their outbound topics. `IntakeRule`
is what the intake decision of one record depends on (the delay policy, the topic's retention and
the subscriptions that honoured delays at that moment). The rule is recorded durably with each
commit, so a rebuild and a later delivery use the rule of the record's first intake, never today's
(the decide-once rule: a policy change applies to records that arrive after it).
"""

from dataclasses import dataclass, field
from typing import Any

from sidecar.policy.model import EffectiveDelay, Sourced, TopicRoute

RECORDED = "the policy in force when the record arrived"


@dataclass(frozen=True)
class IntakeRule:
    delay: EffectiveDelay
    retention_ms: int | None
    delayed: tuple[str, ...]
    """Subscriptions that honoured delays (shared, key_shared) at intake: a delayed record is owed
    to them, and only to them, at its deliver-at."""

    @property
    def keyed(self) -> bool:
        """Records judged by this rule replace their key's pending record (policy/by_key.py)."""
        return self.delay.keyed

    @property
    def key(self) -> tuple[bool, int, int, int, tuple[str, ...], bool]:
        """The rule's values without where they came from: two rules with one key decide alike."""
        retention = -1 if self.retention_ms is None else self.retention_ms
        d = self.delay
        return (d.is_enabled, d.fixed_ms, d.max_ms, retention, self.delayed, d.keyed)

    def encode(self, from_offset: int) -> list[Any]:
        """A keyed rule has a seventh item, 1; others keep the six items they always had, so a
        topic without keys commits the very metadata it did before keys existed."""
        enabled, fixed, max_ms, retention, delayed, keyed = self.key
        item = [from_offset, int(enabled), fixed, max_ms, retention, list(delayed)]
        return [*item, 1] if keyed else item

    @classmethod
    def decode(cls, item: object) -> tuple[int, "IntakeRule"] | None:
        """The (from offset, rule) of one encoded entry; None when it is not one of ours."""
        if not isinstance(item, list) or len(item) not in (6, 7):
            return None
        offset, enabled, fixed, max_ms, retention, delayed = item[:6]
        keyed = item[6] if len(item) == 7 else 0
        if not all(isinstance(v, int) for v in (offset, enabled, fixed, max_ms, retention, keyed)):
            return None
        if not isinstance(delayed, list) or not all(isinstance(s, str) for s in delayed):
            return None
        delay = EffectiveDelay(
            Sourced(bool(enabled), RECORDED),
            Sourced(max_ms, RECORDED),
            Sourced(fixed, RECORDED),
            Sourced("replace" if keyed == 1 else "none", RECORDED),
        )
        return offset, cls(delay, retention if retention >= 0 else None, tuple(delayed))


@dataclass
class Routes:
    """The subscriptions of one inbound topic, split by whether they honour delays."""

    route: TopicRoute
    delayed: list[tuple[str, str]] = field(default_factory=list)
    """(subscription, outbound topic) of shared and key_shared subscriptions."""
    ordered: list[tuple[str, str]] = field(default_factory=list)
    """(subscription, outbound topic) of exclusive and failover subscriptions: everything at once, in order."""
    plain: bool = False
    """A record without headers is delivered at once: delays are on and no fixed delay applies."""
    outbound: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, route: TopicRoute) -> "Routes":
        routes = cls(route, plain=route.delay.is_enabled and route.delay.fixed_ms == 0)
        for sub in route.subscriptions:
            (routes.ordered if sub.ordered else routes.delayed).append((sub.name, sub.outbound))
            routes.outbound[sub.name] = sub.outbound
        return routes

    def rule(self, retention_ms: int | None) -> IntakeRule:
        return IntakeRule(self.route.delay, retention_ms, tuple(name for name, _ in self.delayed))

    def targets(self, rule: IntakeRule) -> list[tuple[str, str]]:
        """Where a delayed record accepted under `rule` goes now: the subscriptions it was owed at
        intake that still exist, whatever their type today (a type change neither loses nor repeats)."""
        return [(name, self.outbound[name]) for name in rule.delayed if name in self.outbound]
