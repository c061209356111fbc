"""The keyed replacement rule (policy/by_key.py) against the rule written out by brute force, live
and from any place a rebuild may start. Pure."""

from itertools import accumulate
from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.policy import by_key
from sidecar.policy.by_key import KeyStep, LogClock, Verdict
from sidecar.tracker.keys import MemoryKeys

NOT_KEYED = Verdict(None, True)
"""A record without a key: it replaces nothing and is delivered."""


class Rec(NamedTuple):
    timestamp: int
    key: bytes | None
    tombstone: bool
    deliver_at: int | None


def by_brute_force(log: list[Rec]) -> list[Verdict]:
    """The rule as the contract words it, one record at a time over the whole log."""
    verdicts, newest = [], {}
    for o, rec in enumerate(log):
        if not rec.key:
            verdicts.append(NOT_KEYED)
            continue
        replaced = None
        if rec.key in newest:
            p = newest[rec.key]
            due = None if log[p].tombstone else log[p].deliver_at
            if due is not None and max(r.timestamp for r in log[: o + 1]) < due:
                replaced = p
        newest[rec.key] = o
        verdicts.append(Verdict(replaced, not rec.tombstone))
    return verdicts


def run(log: list[Rec], start: int = 0) -> list[Verdict]:
    """The step from `start` on, with the log's clock there, as a commit records it."""
    step = KeyStep(MemoryKeys(), max((r.timestamp for r in log[:start]), default=None))
    return [step.take(o, r.timestamp, r.key, r.tombstone, r.deliver_at) for o, r in enumerate(log) if o >= start]


@st.composite
def logs(draw: st.DrawFn) -> list[Rec]:
    """Timestamps mostly in order, some behind (a producer whose clock lags) or ahead; few keys, so
    that they repeat; deliver-at a little after the timestamp, or none (due at once)."""
    n = draw(st.integers(1, 60))
    out, now = [], 1_000
    for _ in range(n):
        now += draw(st.integers(0, 20))
        skew = draw(st.sampled_from([0, 0, 0, -50, 30, 300]))
        key = draw(st.sampled_from([None, b"", b"a", b"b", b"c"]))
        tombstone = key is not None and draw(st.integers(0, 5)) == 0
        at = None if draw(st.integers(0, 4)) == 0 else now + draw(st.integers(1, 120))  # a tombstone's is not kept
        out.append(Rec(now + skew, key, tombstone, at))
    return out


@given(logs())
def test_the_live_step_decides_as_the_rule_says(log: list[Rec]) -> None:
    assert run(log) == by_brute_force(log)


def replaceable(log: list[Rec], cut: int) -> list[int]:
    """Offsets below `cut` that a record at or after it could still replace."""
    newest: dict[bytes, int] = {}
    for o, rec in enumerate(log[:cut]):
        if rec.key:
            newest[rec.key] = o
    return [
        p
        for p in newest.values()
        if not log[p].tombstone
        and log[p].deliver_at is not None
        and max(r.timestamp for r in log[:cut]) < log[p].deliver_at  # type: ignore[operator]
    ]


AHEAD = [Rec(1_300, b"x", False, None), Rec(1_010, b"k", False, 1_100), Rec(1_020, b"k", False, 2_000)]
"""A record stamped ahead (1,300) before the one a rebuild starts at: the log's clock is past 1,100
before k's first record is read, so that record is due at once and nothing replaces it. A rebuild
from offset 1 must start with the clock the commit recorded, or it would decide otherwise."""


@given(logs(), st.data())
def test_a_rebuild_from_before_every_replaceable_record_decides_the_same(log: list[Rec], data: st.DataObject) -> None:
    """A member that starts reading at the partition's earliest pending offset (at or below every
    record that can still be replaced: an entry is pending until the clock gate lets it go) with an
    empty index decides the records from there on as the member that read everything did."""
    cut = data.draw(st.integers(0, len(log)))
    earliest = min(replaceable(log, cut), default=cut)
    start = data.draw(st.integers(0, earliest))
    live = run(log)[cut:]
    rebuilt = run(log, start)[cut - start :]
    assert rebuilt == live


def test_a_timestamp_ahead_before_the_rebuilds_start_is_in_the_clock_it_starts_with() -> None:
    assert replaceable(AHEAD, 2) == []
    assert run(AHEAD)[2] == run(AHEAD, 1)[1] == Verdict(None, True)
    without_clock = KeyStep(MemoryKeys())
    verdicts = [without_clock.take(o, r.timestamp, r.key, r.tombstone, r.deliver_at) for o, r in enumerate(AHEAD) if o]
    assert verdicts[1] == Verdict(1, True)  # what a rebuild would say without the commit's clock


def test_at_the_boundary_a_timestamp_at_the_due_time_keeps_the_old_record() -> None:
    """P due at 2,000; R one millisecond before it replaces P, R at 2,000 does not, and neither
    does R after another key's record stamped 2,000."""
    for r_stamp, between, replaced in ((1_999, None, 0), (2_000, None, None), (1_500, 2_000, None)):
        log = [Rec(1_000, b"k", False, 2_000)]
        if between is not None:
            log.append(Rec(between, b"other", False, None))
        log.append(Rec(r_stamp, b"k", False, 5_000))
        assert run(log)[-1] == Verdict(replaced, True), (r_stamp, between)


def test_a_tombstone_cancels_and_is_not_delivered_and_then_nothing_is_pending() -> None:
    log = [Rec(1_000, b"k", False, 9_000), Rec(1_001, b"k", True, None), Rec(1_002, b"k", False, 9_000)]
    assert run(log) == [Verdict(None, True), Verdict(0, False), Verdict(None, True)]


def test_the_gate_lets_an_entry_go_only_once_a_record_at_its_time_was_read() -> None:
    step = KeyStep(MemoryKeys())
    assert step.due_through(5_000) == -1
    step.take(0, 1_000, b"k", False, 2_000)
    assert step.due_through(5_000) == 1_000  # nothing read at 2,000 yet: the entry waits
    step.take(1, 2_000, None, False, None)
    assert step.due_through(1_990) == 1_990 and step.due_through(5_000) == 2_000
    step.take(2, 1_200, b"j", False, None)  # a producer whose clock lags: the log's clock stays
    assert step.due_through(5_000) == 2_000


@given(st.lists(st.integers(0, 100), max_size=40), st.data())
def test_the_clock_is_sampled_where_a_rebuild_can_start_a_block_at_most_below_any_offset(
    stamps: list[int], data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, len(stamps)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(by_key, "SAMPLE_EVERY", 4)
        clock = LogClock(max(stamps[:start], default=None))  # started where a rebuild would
        for o, t in enumerate(stamps[start:], start):
            clock.note(o, t)
    assert clock.now == max(stamps, default=None)
    forget = data.draw(st.integers(start, len(stamps)))
    clock.forget_below(forget)
    for o in range(forget, len(stamps) + 1):
        sampled = clock.sample(o)
        if start == len(stamps):
            assert sampled is None  # nothing read
            continue
        assert sampled is not None
        at, before = sampled
        assert start <= at <= o and (o - at < 4 or o == len(stamps))
        assert before == max(stamps[:at], default=None)


@given(logs(), st.data())
def test_a_slice_at_once_decides_as_one_record_at_a_time(log: list[Rec], data: st.DataObject) -> None:
    """take_many, the intake's path, against take: cut into slices, the same offsets replaced, and
    the clock sampled at the same offsets."""
    step, one_by_one = KeyStep(MemoryKeys()), KeyStep(MemoryKeys())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(log)), max_size=4)))
    got: list[int | None] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(by_key, "SAMPLE_EVERY", 4)
        for lo, hi in zip([0, *cuts], [*cuts, len(log)], strict=True):
            part = list(enumerate(log))[lo:hi]
            got += step.take_many([o for o, _ in part], [r.timestamp for _, r in part], [r.key for _, r in part],
                                  [r.tombstone for _, r in part], [r.deliver_at for _, r in part])  # fmt: skip
        for o, r in enumerate(log):
            one_by_one.take(o, r.timestamp, r.key, r.tombstone, r.deliver_at)
    assert got == [v.replaced for v in by_brute_force(log)]
    assert [step.clock.sample(o) for o in range(len(log))] == [one_by_one.clock.sample(o) for o in range(len(log))]


@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 100)), max_size=40), st.data())
def test_a_slice_samples_the_clock_as_note_does_across_gaps_in_the_offsets(
    gaps_and_stamps: list[tuple[int, int]], data: st.DataObject
) -> None:
    """Offsets with gaps (transaction markers; records of another rule, noted apart): the sampling
    inlined in take_many is LogClock.note's, slice by slice."""
    offsets = list(accumulate(gap for gap, _ in gaps_and_stamps))
    stamps = [stamp for _, stamp in gaps_and_stamps]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(offsets)), max_size=4)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(by_key, "SAMPLE_EVERY", 4)
        step, reference = KeyStep(MemoryKeys()), LogClock()
        for lo, hi in zip([0, *cuts], [*cuts, len(offsets)], strict=True):
            n = hi - lo
            step.take_many(offsets[lo:hi], stamps[lo:hi], [b"k"] * n, [False] * n, [None] * n)
        for offset, stamp in zip(offsets, stamps, strict=True):
            reference.note(offset, stamp)
    assert (step.clock.now, step.clock._offsets, step.clock._before) == (
        reference.now,
        reference._offsets,
        reference._before,
    )
