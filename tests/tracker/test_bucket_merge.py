"""Merging sealed buckets: which run is merged, and that a merge keeps every entry not durably delivered."""

from __future__ import annotations

import logging
import random

import pytest

from sidecar.clock import ManualClock
from sidecar.tracker.base import Due
from sidecar.tracker.bucket.immutable import ImmutableBucket
from sidecar.tracker.bucket.merge import best_run, merge_buckets
from sidecar.tracker.memory import InMemoryTracker
from sidecar.tracker.storage import FakeSnapshotStorage, Segment
from sidecar.tracker.storage.base import pack_key

from .conftest import drain, make_tracker, ordered, sealed_bucket

# -- choosing and building a merge -------------------------------------------------------------


def test_the_run_merged_is_up_to_four_adjacent_buckets_with_fewest_pending() -> None:
    def buckets(*pending: int) -> list[ImmutableBucket]:
        return [sealed_bucket(i, [(100, i)], pending=list(range(p)))[0] for i, p in enumerate(pending)]

    assert best_run(buckets(5, 1, 1, 1, 1, 9)) == (1, 4)
    assert best_run(buckets(3, 1, 1)) == (1, 2)  # never all of them: the largest is left out
    assert best_run(buckets(3, 1)) == (0, 2)


def test_a_merge_keeps_pops_not_yet_durable_unless_their_offset_is_pending_again() -> None:
    """Offsets 0 and 1 were popped, not checkpointed; offset 0 was re-added (a nack) later."""
    first, first_segments = sealed_bucket(1, [(10, 0), (20, 1)], pending=[])
    second, second_segments = sealed_bucket(2, [(30, 0), (40, 2)], pending=[0, 2])
    stored = {1: first_segments, 2: second_segments}

    def load(bucket_id: int, first: int, end: int) -> list[Segment]:
        return stored[bucket_id][first:end]

    options = {"step": 50, "max_per_segment": 10, "load": load}
    merged = merge_buckets([first, second], 3, durable=0, popped=pack_key(20, 1), **options)
    assert merged is not None
    bucket, write = merged
    keys = [pack_key(d, o) for s in write.segments.values() for d, o in zip(s.deliver_at, s.offsets, strict=True)]
    assert keys == [pack_key(20, 1), pack_key(30, 0), pack_key(40, 2)]
    assert bucket.bucket_id == 3 and bucket.pending == 2 and list(bucket.bitmap) == [0, 2]
    assert merge_buckets([first, second], 3, durable=pack_key(40, 2), popped=pack_key(40, 2), **options) is None


# -- merges in the tracker ---------------------------------------------------------------------


def test_merge_keeps_every_segment(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """Pulsar #26251: count before restart == count after, and every message is delivered."""
    rng = random.Random(11)
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=2)
    expected = []
    for i in range(400):
        at = start + 1 + rng.randrange(3000)
        tracker.add(i, at)
        expected.append(Due(at, i))
    stats = tracker.stats()
    assert stats.ops.get(("merge", "succeed"), 0) > 10
    assert stats.buckets <= 2
    tracker.checkpoint(400)
    recovered = make_tracker(clock, storage, max_buckets=2)
    assert len(recovered) == len(tracker) == 400
    assert drain(recovered, clock, start + 3001, step=50) == sorted(expected)


@pytest.mark.parametrize("max_buckets", [1, 2, 3])
def test_merge_with_few_max_buckets(clock: ManualClock, storage: FakeSnapshotStorage, max_buckets: int) -> None:
    rng = random.Random(max_buckets)
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=max_buckets)
    model = InMemoryTracker(clock)
    got: list[Due] = []
    want: list[Due] = []
    for i in range(250):
        at = clock.now_ms() + 1 + rng.randrange(500)
        assert tracker.add(i, at) == model.add(i, at)
        assert tracker.stats().buckets <= max_buckets
        if i % 25 == 0:
            clock.advance(rng.randrange(60))
            got += tracker.pop_due(1000)
            want += model.pop_due(1000)
            tracker.checkpoint(i + 1)
    got += drain(tracker, clock, start + 2000)
    want += drain(model, clock, start + 2000)
    assert got == want and len(got) == 250


def test_merge_takes_four_adjacent_buckets_with_fewest_pending(
    clock: ManualClock, storage: FakeSnapshotStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """Pulsar merges up to 4 adjacent buckets, fewest pending first; pops not yet durable survive it."""
    caplog.set_level(logging.INFO, logger="sidecar.tracker.bucket.tracker")
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=50)
    expected = []
    for i in range(60):
        # Buckets 5 and 6 (offsets 40..59) hold the earliest entries: popping them leaves them smaller.
        at = start + 10 + i % 10 if i >= 40 else start + 1000 + i
        tracker.add(i, at)
        expected.append(Due(at, i))
    assert tracker.seal() and tracker.stats().buckets == 6
    tracker.checkpoint(60)
    clock.set(start + 14)
    popped = tracker.pop_due(100)
    assert [d.offset for d in popped] == [40, 50, 41, 51, 42, 52, 43, 53, 44, 54]
    assert tracker.merge()
    meta = storage.load_partition("orders/0")
    assert meta is not None and meta.bucket_ids == [1, 2, 7]
    assert any("buckets=3,4,5,6 into=7 entries=40" in r.message for r in caplog.records)
    assert len(tracker) == 50 and all(tracker.contains(i) == (i % 10 >= 5) for i in range(40, 60))
    # A crash before the next checkpoint: the five pops were not durable, so they come back.
    crashed = make_tracker(clock, storage, max_buckets=50)
    assert len(crashed) == 60
    clock.set(start + 2000)
    assert crashed.pop_due(1000) == sorted(expected)
    clock.set(start + 14)
    tracker.checkpoint(60)
    recovered = make_tracker(clock, storage, max_buckets=50)
    assert len(recovered) == 50
    clock.set(start + 2000)
    assert recovered.pop_due(1000) == sorted(expected)[10:]


def test_merges_over_the_limit_go_four_at_a_time(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=6)
    for i in range(80):
        tracker.add(i, start + 10 + (i * 37) % 500)
    # 7 sealed buckets is one over the limit: one merge of 4 leaves 4, not 6.
    assert tracker.stats().buckets == 4
    assert tracker.stats().ops[("merge", "succeed")] == 1
    tracker.checkpoint(80)
    recovered = make_tracker(clock, storage, max_buckets=6)
    got = drain(recovered, clock, start + 600)
    assert sorted(d.offset for d in got) == list(range(80)) and ordered(got)


def test_merge_reads_sources_in_chunks(
    clock: ManualClock, storage: FakeSnapshotStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge reads a few segments per storage call and cuts a few windows at once; the order and
    the pops must not depend on either."""
    monkeypatch.setattr("sidecar.tracker.bucket.merge._READ_CHUNK", 3)
    monkeypatch.setattr("sidecar.tracker.bucket.merge._CUT_BATCH", 5)
    rng = random.Random(3)
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=3, time_step_ms=10, max_indexes_per_segment=2)
    model = InMemoryTracker(clock)
    got: list[Due] = []
    want: list[Due] = []
    for i in range(400):
        at = clock.now_ms() + 1 + rng.randrange(800)
        assert tracker.add(i, at) == model.add(i, at)
        if i % 30 == 0:
            clock.advance(rng.randrange(40))
            got += tracker.pop_due(1000)
            want += model.pop_due(1000)
            if i % 60 == 0:
                tracker.checkpoint(i + 1)
    assert tracker.stats().ops[("merge", "succeed")] > 10
    got += drain(tracker, clock, start + 2000)
    want += drain(model, clock, start + 2000)
    assert got == want and len(got) == 400


def test_fault_on_merge_keeps_buckets(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=2, retry_interval_ms=10_000)
    storage.fail("merge", 2)
    for i in range(45):
        tracker.add(i, start + 10 + i)
    assert tracker.degraded and tracker.stats().buckets == 3
    tracker.checkpoint(45)
    assert not tracker.stats().degraded and tracker.stats().buckets == 2
    recovered = make_tracker(clock, storage, max_buckets=2)
    assert [d.offset for d in drain(recovered, clock, start + 100)] == list(range(45))
