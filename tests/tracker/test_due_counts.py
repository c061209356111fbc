"""The pending-by-due-time counts: exact in memory, within a segment's share for sealed buckets."""

import random

from sidecar.clock import ManualClock
from sidecar.tracker.memory import InMemoryTracker
from sidecar.tracker.storage import FakeSnapshotStorage
from tests.tracker.conftest import make_tracker


def exact(ats: list[int], limits: list[int]) -> list[int]:
    return [sum(1 for at in ats if at <= limit) for limit in limits]


def test_the_memory_tracker_counts_exactly(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    ats = [clock.now_ms() + random.Random(1).randrange(1, 100_000) + i for i in range(500)]
    for offset, at in enumerate(ats):
        tracker.add(offset, at)
    limits = [clock.now_ms() + n for n in (1_000, 30_000, 99_000, 200_000)]
    assert tracker.due_counts(limits) == exact(ats, limits)


def test_the_bucket_tracker_is_within_one_segment_per_bucket_and_follows_pops(
    clock: ManualClock, storage: FakeSnapshotStorage
) -> None:
    tracker = make_tracker(clock, storage)
    rng = random.Random(7)
    ats = [clock.now_ms() + rng.randrange(1, 5_000) for _ in range(600)]
    for offset, at in enumerate(ats):
        tracker.add(offset, at)
    tracker.checkpoint(600)
    assert tracker.stats().buckets > 1, "sealed buckets, not only the mutable one"
    limits = [clock.now_ms() + n for n in (500, 2_500, 10_000)]
    slack = 4 * (tracker.stats().buckets + 1)  # at most one segment (of 4 entries) per bucket and limit
    for got, want in zip(tracker.due_counts(limits), exact(ats, limits), strict=True):
        assert abs(got - want) <= slack, (got, want)
    assert tracker.due_counts(limits)[-1] == 600
    clock.advance(2_500)
    popped = len(tracker.pop_due(10_000))
    left = [at for at in ats if at > clock.now_ms()]
    assert popped == 600 - len(left)
    got = tracker.due_counts([clock.now_ms() + 10_000])
    assert got == [len(left)]
