"""The fates the churn run (bench/churn.py) allows each record, and the count of the fates it got.

What a record may become depends on its topic, what it asked for, when it was produced against the
run's policy events, and, at least once, on the faults near its copies: `dead_letter_rules` and the
windows in `count` say which. The count reads every outbound, dead-letter and outcomes topic to its
high watermark, read_committed, and `disagreements` holds it against the Spark audit's report.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from bench.chaos import CONTROL, Plan, SparkAudit, read_all
from sidecar.control.cancels import COMMAND_BY
from sidecar.outbound.records import read_delivery
from sidecar.policy.by_key import KeyStep
from sidecar.tracker.keys import MemoryKeys

TOPICS: dict[str, tuple[str, ...]] = {
    "steady": ("a", "b"),
    "removable": ("a",),
    "late": ("a",),
    "capped": ("a",),
    "keyed": ("a",),
}
"""Inbound topic -> its subscriptions (all shared: every one honours delays)."""
KEYED = "keyed"
"""The topic with `by_key: replace`: records with keys, a few of them tombstones."""
PARTITIONS = 2
MEMBERS = 3
REPEAT_WINDOW_S = 20.0
"""At least once, how long before a fault a repeated record's first copy may have been written: a
commit every 0.5 s, checkpoints put off up to 15 s while writes go unacknowledged (contract section 4)."""
SETTLE_S = 3.0
"""A policy file change is in force on every running member this long after it is written (checked
every 0.5 s, applied once unchanged for 1 s: contract section 2)."""
REPEATING = frozenset({"kill", "state", "zombie", "broker"})
"""Faults after which, at least once, what was written since the last commit may be written again."""


@dataclass
class ChurnPlan(Plan):
    guarantee: str = "exactly-once"
    delay_s: float = 20.0
    """Records ask for deliver-after 0 to this; cancels are sent within it of their record."""
    tight_s: float = 10.0
    """`capped`'s max delay once tightened."""
    members: int = MEMBERS

    def __post_init__(self) -> None:
        if self.guarantee not in ("exactly-once", "at-least-once"):
            raise ValueError(f"guarantee: exactly-once or at-least-once, not {self.guarantee!r}")


@dataclass
class Event:
    kind: str
    start_ms: int
    end_ms: int
    detail: str = ""


@dataclass
class Fates:
    """What the outbound, dead-letter and outcomes topics hold, record by record (read_committed)."""

    produced: dict[str, int] = field(default_factory=dict)
    delivered: dict[str, int] = field(default_factory=dict)
    """Per `topic.subscription`: records delivered there, with no other fate."""
    dead_lettered: dict[str, int] = field(default_factory=dict)
    """Per `topic code`: records dead-lettered with that code."""
    dead_letters: Counter[str] = field(default_factory=Counter)
    """Per `topic code`: dead-letter records, copies included (the audit's `rejections`)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Per topic: records on its dead-letter topic, whatever else became of them (the audit's `rejected`)."""
    cancelled: int = 0
    either: dict[str, int] = field(default_factory=dict)
    """Per topic: records that could have had either of two fates (see the module's docstring)."""
    lost: dict[str, int] = field(default_factory=dict)
    """Per `topic.subscription`: records with no fate there."""
    duplicated: dict[str, int] = field(default_factory=dict)
    """Per `topic.subscription` and `topic.dlt`: extra copies."""
    repeats_allowed: int = 0
    """At least once: extra copies whose first copy came in REPEAT_WINDOW_S before a fault."""
    early: dict[str, int] = field(default_factory=dict)
    two_fates: int = 0
    """Dead-lettered or cancelled, and delivered too."""
    dead_and_delivered: int = 0
    two_fates_allowed: int = 0
    """At least once, records that a member delivered and then died or lost before its next commit,
    which the next owner, knowing only the commit, cancelled on a cancel that came since, or
    dead-lettered on the topic's removal (or dead-lettered, then delivered once the topic came
    back): contract section 4."""
    cancelled_and_delivered: int = 0
    replaced: dict[str, int] = field(default_factory=dict)
    """Per keyed topic: records replaced by a newer record of their key, or tombstones: owed to nobody."""
    replaced_delivered: int = 0
    """Records of a keyed topic that the rule replaced (or tombstones), delivered all the same."""
    wrong_code: int = 0
    """Dead-lettered with a code its topic and delay do not allow."""
    wrong_fate: int = 0
    """A record whose fate the policy in force when it was produced decides, with the other fate."""
    cancels_sent: int = 0
    cancels_not_answered_once: int = 0
    answers_repeated_allowed: int = 0
    """At least once: cancels answered again (maybe otherwise) after a fault."""
    examples: list[str] = field(default_factory=list)
    """A few anomalous records, for the report."""

    @property
    def repeats_unexplained(self) -> int:
        return sum(self.duplicated.values()) - self.repeats_allowed

    @property
    def anomalies(self) -> int:
        return (
            sum(self.lost.values())
            + self.repeats_unexplained
            + sum(self.early.values())
            + self.two_fates
            - self.two_fates_allowed
            + self.wrong_code
            + self.wrong_fate
            + self.cancels_not_answered_once
            + self.replaced_delivered
        )


def count(
    bootstrap: str,
    asked: dict[tuple[str, int, int], tuple[int, int]],
    cancels: dict[str, tuple[int, int]],
    events: list[Event],
    plan: ChurnPlan,
) -> Fates:
    """Every produced record's fate, from the topics as a read_committed consumer sees them."""
    fates = Fates(cancels_sent=len(cancels))
    windows = [(e.start_ms - REPEAT_WINDOW_S * 1000, e.end_ms + 5000.0) for e in events if e.kind in REPEATING]
    repeats_allowed = plan.guarantee == "at-least-once"
    answers: dict[str, list[tuple[str, int]]] = {}
    for m in read_all(bootstrap, f"{CONTROL}.outcomes"):
        data = json.loads(m.value())
        answers.setdefault(data.get("id") or "", []).append((data.get("outcome", ""), m.timestamp()[1]))
    # Any `cancelled` answer counts, as in the Spark audit: at least once a cancel can be answered
    # again, otherwise, and a record both answered `cancelled` and delivered has two fates.
    cancelled = {cancels[i] for i, said in answers.items() if i in cancels and any(o == "cancelled" for o, _ in said)}
    fates.cancelled = len(cancelled)
    for command_id, origin in cancels.items():
        said = answers.get(command_id, [])
        # At least once, an answer is an output like any other: given again after a fault, and
        # decided again (contract section 4).
        if len(said) > 1 and repeats_allowed and _near(said[0][1], windows):
            fates.answers_repeated_allowed += 1
        elif len(said) != 1:
            fates.cancels_not_answered_once += 1
            trail = _trail(bootstrap, origin)
            fates.examples.append(f"cancel {command_id} of steady/{origin[0]}/{origin[1]} answered {said}; {trail}")

    def extra(first_ms: list[int], name: str) -> None:
        """Count a record's copies past the first, at least once allowed near a fault."""
        if len(first_ms) > 1:
            fates.duplicated[name] = fates.duplicated.get(name, 0) + len(first_ms) - 1
            if repeats_allowed and _near(min(first_ms), windows):
                fates.repeats_allowed += len(first_ms) - 1

    removed = _span(events, "remove", "readd")
    died_draining = removed is not None and any(
        e.kind in REPEATING and removed[0] - SETTLE_S * 1000 <= e.start_ms <= removed[1] for e in events
    )
    tightened = next((e.end_ms for e in events if e.kind == "tighten"), None)
    for topic, subs in TOPICS.items():
        copies: dict[str, dict[tuple[int, int], list[int]]] = {s: {} for s in subs}
        for sub in subs:
            early = 0
            for m in read_all(bootstrap, f"{topic}.{sub}"):
                d = read_delivery(dict(m.headers() or []))
                copies[sub].setdefault((d.partition, d.offset), []).append(m.timestamp()[1])
                early += m.timestamp()[1] < d.deliver_at
            fates.early[f"{topic}.{sub}"] = early
        dead: dict[tuple[int, int], list[tuple[str, int]]] = {}
        for m in read_all(bootstrap, f"{topic}.dlt"):
            h = {k: v.decode() for k, v in (m.headers() or []) if v is not None}
            origin = (int(h["delay-origin-partition"]), int(h["delay-origin-offset"]))
            dead.setdefault(origin, []).append((h.get("delay-error-code", ""), m.timestamp()[1]))
        not_owed = replaced_by_key(bootstrap, topic) if topic == KEYED else set()
        records = [(p, o) for (t, p, o) in asked if t == topic]
        fates.produced[topic] = len(records)
        for p, o in records:
            delay_ms, at_ms = asked[(topic, p, o)]
            delivered = [s for s in subs if (p, o) in copies[s]]
            for s in delivered:
                extra(copies[s][(p, o)], f"{topic}.{s}")
            codes = dead.get((p, o), [])
            extra([ms for _, ms in codes], f"{topic}.dlt")
            fates.rejected[topic] = fates.rejected.get(topic, 0) + bool(codes)
            fates.dead_letters.update(f"{topic} {code}" for code, _ in codes)
            gone = topic == "steady" and (p, o) in cancelled
            may_die, must_die = dead_letter_rules(topic, delay_ms, at_ms, plan, removed, tightened)
            fates.either[topic] = fates.either.get(topic, 0) + (may_die and not must_die)
            example = (
                f"{topic}/{p}/{o} (asked {delay_ms} ms at {at_ms}): delivered to {delivered}, dead-lettered {codes}"
            )
            if (codes or gone) and delivered:
                fates.two_fates += 1
                fates.dead_and_delivered += bool(codes)
                fates.cancelled_and_delivered += len(delivered) if gone else 0  # per subscription, as the audit
                redone = died_draining or any(_near(min(copies[s][(p, o)]), windows) for s in delivered)
                if repeats_allowed and redone and (gone or {c for c, _ in codes} == {"TOPIC_REMOVED"}):
                    fates.two_fates_allowed += 1
                else:
                    fates.examples.append("two fates: " + example)
            elif codes:
                fates.dead_lettered[f"{topic} {codes[0][0]}"] = fates.dead_lettered.get(f"{topic} {codes[0][0]}", 0) + 1
                if any(code != _code(topic) for code, _ in codes):
                    fates.wrong_code += 1
                    fates.examples.append("wrong code: " + example)
                elif not may_die:
                    fates.wrong_fate += 1  # e.g. a removable record read only after it came back
                    fates.examples.append("dead-lettered past the policy in force: " + example)
            elif (p, o) in not_owed:
                fates.replaced[topic] = fates.replaced.get(topic, 0) + 1
                if delivered:
                    fates.replaced_delivered += 1
                    fates.examples.append("replaced (or a tombstone) and delivered: " + example)
            elif not gone:
                if must_die and delivered:
                    fates.wrong_fate += 1
                    fates.examples.append("delivered past the policy in force: " + example)
                for s in subs:
                    name = f"{topic}.{s}"
                    if s in delivered:
                        fates.delivered[name] = fates.delivered.get(name, 0) + 1
                    else:
                        fates.lost[name] = fates.lost.get(name, 0) + 1
    del fates.examples[20:]
    return fates


def replaced_by_key(bootstrap: str, topic: str) -> set[tuple[int, int]]:
    """(partition, offset) of the topic's records that no subscription is owed: replaced by a newer
    record of their key, or tombstones. The contract's rule (sidecar.policy.by_key) over the log as a
    read_committed consumer sees it, the sidecar's own records included (their timestamps count).
    No record of this topic is dead-lettered in the run, so none is left out of the rule."""
    steps: dict[int, KeyStep] = {}
    not_owed: set[tuple[int, int]] = set()
    for m in sorted(read_all(bootstrap, topic), key=lambda m: (m.partition(), m.offset())):
        step = steps.setdefault(m.partition(), KeyStep(MemoryKeys()))
        headers = m.headers() or []
        stamp = max(m.timestamp()[1], 0)
        if headers and headers[0][0] == COMMAND_BY:
            step.note(m.offset(), stamp)
            continue
        delay = int(dict(headers).get("deliver-after") or 0)
        tombstone = bool(m.key()) and m.value() is None
        verdict = step.take(m.offset(), stamp, m.key(), tombstone, stamp + delay if delay > 0 else None)
        if verdict.replaced is not None:
            not_owed.add((m.partition(), verdict.replaced))
        if tombstone:
            not_owed.add((m.partition(), m.offset()))
    return not_owed


def _trail(bootstrap: str, origin: tuple[int, int]) -> str:
    """The requests and facts about one record in its partition, with the offset, timestamp and
    what each says: which owner decided what, once or twice (read uncommitted, aborted ones too)."""
    partition, offset = origin
    found = []
    for m in read_all(bootstrap, "steady", committed_only=False):
        headers = m.headers() or []
        if m.partition() != partition or len(headers) < 2 or headers[0][0] != COMMAND_BY:
            continue
        try:
            data = json.loads(headers[1][1] or b"")
        except ValueError:
            continue
        if data.get("offset") == offset or data.get("origin") == offset:
            found.append(f"{headers[1][0]}@{m.offset()} t={m.timestamp()[1]} {json.dumps(data)}")
    return "requests and facts: " + (" | ".join(found) or "none")


def _near(ms: int, windows: list[tuple[float, float]]) -> bool:
    return any(lo <= ms <= hi for lo, hi in windows)


def _span(events: list[Event], start: str, end: str) -> tuple[int, int] | None:
    """(the first event's end, the second's start), wall-clock ms."""
    first = next((e for e in events if e.kind == start), None)
    second = next((e for e in events if e.kind == end), None)
    return (first.end_ms, second.start_ms if second else 2**62) if first else None


def _code(topic: str) -> str:
    return {"removable": "TOPIC_REMOVED", "capped": "EXCEEDS_MAX_DELAY"}.get(topic, "")


def dead_letter_rules(
    topic: str, delay_ms: int, at_ms: int, plan: ChurnPlan, removed: tuple[int, int] | None, tightened: int | None
) -> tuple[bool, bool]:
    """(may it be dead-lettered, must it be): a removable record produced before the removal was in
    force may have been pending then; a capped record over the tight max must be refused once the
    tightening was in force when it was produced, and may be if it was produced before."""
    if topic == "removable":
        return removed is not None and at_ms < removed[0] + SETTLE_S * 1000, False
    if topic == "capped" and delay_ms > plan.tight_s * 1000 and tightened is not None:
        return True, at_ms > tightened
    return False, False


def disagreements(fates: Fates, spark: SparkAudit) -> list[str]:
    """Each count where the Spark audit and the bench's own count differ, in words."""
    if spark.exit_code not in (0, 1) or not spark.report:
        return [f"the Spark audit gave no counts (exit {spark.exit_code})"]
    found: list[str] = []
    summaries = {f"{s['topic']}.{s['subscription']}": s for s in spark.report["subscriptions"]}
    for topic, subs in TOPICS.items():
        rejected = fates.rejected.get(topic, 0)
        for sub in subs:
            name, s = f"{topic}.{sub}", summaries.get(f"{topic}.{sub}")
            if s is None:
                found.append(f"{name}: not in the Spark audit's report")
                continue
            pairs = [
                ("inbound", fates.produced.get(topic, 0), s["inbound"]),
                ("rejected", rejected, s["rejected"]),
                ("delivered", fates.delivered.get(name, 0), s["delivered"]),
                ("lost", fates.lost.get(name, 0), s["missing"] + s["pending"]),
                ("duplicated", fates.duplicated.get(name, 0), s["duplicates"]),
                ("early", fates.early.get(name, 0), s["early"]),
                ("cancelled", fates.cancelled if topic == "steady" else 0, s.get("cancelled", 0)),
                ("replaced", fates.replaced.get(topic, 0), s.get("replaced", 0) + s.get("tombstones", 0)),
            ]
            found += [f"{what} ({name}): bench {mine}, Spark audit {theirs}" for what, mine, theirs in pairs
                      if mine != theirs]  # fmt: skip
    counts = spark.report.get("anomaly_counts", {})
    total_duplicates = sum(fates.duplicated.values())
    for what, mine, theirs in (
        ("copies past the first, dead letters included", total_duplicates, counts.get("duplicate", 0)),
        ("dead-lettered and delivered", fates.dead_and_delivered, counts.get("rejected_and_delivered", 0)),
        ("delivered after a cancel", fates.cancelled_and_delivered, counts.get("delivered_after_cancel", 0)),
        ("replaced and delivered", fates.replaced_delivered, counts.get("delivered_replaced", 0)),
    ):
        if mine != theirs:
            found.append(f"{what}: bench {mine}, Spark audit {theirs}")
    by_code = {f"{r['topic']} {r['code']}": r["count"] for r in spark.report.get("rejections", [])}
    mine_by_code = dict(fates.dead_letters)
    if {k: v for k, v in by_code.items() if v} != mine_by_code:
        found.append(f"dead-letter records by topic and code: bench {mine_by_code}, Spark audit {by_code}")
    return found
