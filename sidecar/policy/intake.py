"""The fate of one inbound record, decided once: deliver now, delay until T, or reject with a code.

Pure code. Live intake and the rebuild of a lost index both call `judge`, with the rule that was in
force when the record first arrived, so they cannot disagree.
"""

from collections.abc import Sequence
from typing import NamedTuple

from sidecar.errors import RejectedRecord
from sidecar.policy.evaluate import decide
from sidecar.policy.headers import Headers
from sidecar.policy.routes import IntakeRule


class Fate(NamedTuple):
    deliver_at: int | None
    """None: every subscription gets the record now. Otherwise the subscriptions of `rule.delayed`
    get it at deliver_at (now, if that has passed) and ordered subscriptions get it now."""
    rejected: RejectedRecord | None = None
    """Set when the record goes to the dead-letter topic instead, with this code and message."""
    overridden: bool = False
    """A fixed delay replaced the producer's header (counted)."""
    disabled: bool = False
    """The record asked for a delay on a topic whose delays are disabled (counted)."""
    miscased: bool = False
    """A header like `Deliver-At`, which is not a delay header: names are case-sensitive (counted)."""


def judge(rule: IntakeRule, headers: Headers, publish_ms: int) -> Fate:
    try:
        decision = decide(rule.delay, headers, publish_ms, rule.retention_ms)
    except RejectedRecord as rejected:
        return Fate(None, rejected)
    deliver_at = decision.deliver_at if rule.delayed else None
    return Fate(deliver_at, None, decision.overridden, decision.disabled, decision.miscased)


class Judge:
    """`judge`, with a shortcut for records without headers: their fate depends on the rule alone
    (deliver-at is the publish time plus a constant, or none, or a rejection), so it is worked out
    once per rule. Fixed-delay topics judge every record twice (at intake and when a run is read
    back), and their records seldom carry headers."""

    _KEEP = 64

    def __init__(self) -> None:
        self._plain: dict[int, tuple[IntakeRule, Fate]] = {}

    def __call__(self, rule: IntakeRule, headers: Headers, publish_ms: int) -> Fate:
        if headers is not None:
            return judge(rule, headers, publish_ms)
        fate = self._plain_fate(rule)
        return fate if fate.deliver_at is None else Fate(fate.deliver_at + publish_ms)

    def many(self, rule: IntakeRule, records: Sequence[tuple[Headers, int]]) -> list[Fate]:
        """The fates of (headers, publish ms) judged under one rule, in order: what calling this
        judge on each would give. A record without headers costs a comparison, not a decision."""
        plain = self._plain_fate(rule)
        shift = plain.deliver_at
        fates: list[Fate] = []
        add = fates.append
        for headers, publish_ms in records:
            if headers is not None:
                add(judge(rule, headers, publish_ms))
            elif shift is None:
                add(plain)
            else:
                add(Fate(shift + publish_ms))
        return fates

    def _plain_fate(self, rule: IntakeRule) -> Fate:
        """The fate of a record without headers published at 0 under `rule`."""
        entry = self._plain.get(id(rule))
        if entry is None or entry[0] is not rule:
            if len(self._plain) >= self._KEEP:  # rules are made per batch: keep the recent ones
                self._plain.clear()
            entry = self._plain[id(rule)] = (rule, judge(rule, None, 0))
        return entry[1]
