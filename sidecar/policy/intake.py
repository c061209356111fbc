"""The fate of one inbound record, decided once: deliver now, delay until T, or reject with a code.

Pure code. Live intake and the rebuild of a lost index both call `judge`, with the rule that was in
force when the record first arrived, so they cannot disagree.
"""

from collections.abc import Sequence
from typing import NamedTuple

from sidecar.durations import MAX_EPOCH_MS
from sidecar.errors import RejectedRecord
from sidecar.policy.evaluate import decide
from sidecar.policy.headers import DELIVER_AFTER, DELIVER_AT, Headers
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


class _Digits:
    """A rule's fate for the common header: one `deliver-at` or `deliver-after` whose value is plain
    digits (epoch ms, or ms). Such a header cannot be invalid, so its fate is arithmetic; the few
    that are rejected are left to `judge`, which words the reason."""

    def __init__(self, rule: IntakeRule) -> None:
        delay = rule.delay
        self.enabled, self.fixed_ms, self.max_ms = delay.is_enabled, delay.fixed_ms, delay.max_ms
        self.retention_ms = -1 if rule.retention_ms is None else rule.retention_ms
        self.delayed = bool(rule.delayed)

    def fate(self, name: str, raw: bytes | None, publish_ms: int) -> Fate | None:
        """What `judge` gives [(name, raw)], or None where it takes `judge` to say."""
        if not raw or len(raw) > 18 or not raw.isdigit():  # bytes.isdigit: ASCII digits only
            return None
        value = int(raw)
        requested = value if name == DELIVER_AT else publish_ms + value
        if requested > MAX_EPOCH_MS:
            return None
        if not self.enabled:
            return _DISABLED
        if self.fixed_ms > 0:
            delay, deliver_at, overridden = self.fixed_ms, publish_ms + self.fixed_ms, True
        elif requested <= publish_ms:
            return _NOW
        else:
            delay, deliver_at, overridden = requested - publish_ms, requested, False
            if 0 < self.max_ms < delay:
                return None
        if 0 <= self.retention_ms < delay:
            return None
        return Fate(deliver_at if self.delayed else None, None, overridden)


_NOW = Fate(None)
_DISABLED = Fate(None, disabled=True)
_DELAY_NAMES = (DELIVER_AT, DELIVER_AFTER)


class Judge:
    """`judge`, with shortcuts for the two common kinds of record.

    - Without headers, the fate depends on the rule alone (deliver-at is the publish time plus a
      constant, or none, or a rejection), so it is worked out once per rule. Records of fixed-delay
      topics seldom carry headers.
    - With one delay header of plain digits, the fate is arithmetic on the rule's values (`_Digits`):
      a third of the cost of parsing the header and building the decision.
    """

    _KEEP = 64

    def __init__(self) -> None:
        self._rules: dict[int, tuple[IntakeRule, Fate, _Digits]] = {}

    def __call__(self, rule: IntakeRule, headers: Headers, publish_ms: int) -> Fate:
        """One record: `many` of one (a list and a tuple more than a copy of its loop would cost)."""
        return self.many(rule, [(headers, publish_ms)])[0]

    def many(self, rule: IntakeRule, records: Sequence[tuple[Headers, int]]) -> list[Fate]:
        """The fates of (headers, publish ms) judged under one rule, in order: what calling this
        judge on each would give, with the shortcuts inlined."""
        _, plain, digits = self._of(rule)
        shift = plain.deliver_at
        fates: list[Fate] = []
        add = fates.append
        for headers, publish_ms in records:
            if headers is None:
                add(plain if shift is None else Fate(shift + publish_ms))
                continue
            if len(headers) == 1:
                name, raw = headers[0]
                if name in _DELAY_NAMES and (fate := digits.fate(name, raw, publish_ms)) is not None:
                    add(fate)
                    continue
            add(judge(rule, headers, publish_ms))
        return fates

    def _of(self, rule: IntakeRule) -> tuple[IntakeRule, Fate, _Digits]:
        """The rule's shortcuts: the fate of a record without headers published at 0, and `_Digits`."""
        entry = self._rules.get(id(rule))
        if entry is None or entry[0] is not rule:
            if len(self._rules) >= self._KEEP:  # rules are made per batch: keep the recent ones
                self._rules.clear()
            entry = self._rules[id(rule)] = (rule, judge(rule, None, 0), _Digits(rule))
        return entry
