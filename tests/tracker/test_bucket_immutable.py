"""Sealed buckets: segments cut by time window, segment loading, and what is deleted once delivered."""

from __future__ import annotations

import random

import pytest
from pyroaring import BitMap64

from sidecar.clock import ManualClock
from sidecar.errors import StorageError
from sidecar.tracker.base import Due
from sidecar.tracker.bucket.immutable import cut_segments, latest_per_offset
from sidecar.tracker.storage import FakeSnapshotStorage, Segment
from sidecar.tracker.storage.base import pack_key

from .conftest import drain, make_tracker, sealed_bucket

# -- the snapshot format -----------------------------------------------------------------------


def test_segments_are_cut_on_epoch_aligned_windows_at_most_max_long() -> None:
    keys = [pack_key(at, offset) for offset, at in enumerate([100, 120, 149, 150, 151, 152, 153, 199, 200])]
    segments = cut_segments(keys, 50, 3)
    assert [list(s.deliver_at) for s in segments] == [[100, 120, 149], [150, 151, 152], [153, 199], [200]]
    assert [list(s.offsets) for s in segments] == [[0, 1, 2], [3, 4, 5], [6, 7], [8]]


def test_a_snapshot_keeps_one_popped_key_per_offset_and_none_for_an_offset_pending_again() -> None:
    popped = [pack_key(10, 1), pack_key(11, 2), pack_key(12, 1), pack_key(13, 3)]
    assert latest_per_offset(popped, BitMap64([3])) == [pack_key(11, 2), pack_key(12, 1)]


def test_a_bucket_whose_segment_fails_to_load_is_blocked_at_that_segment() -> None:
    """Its head becomes a barrier no later than anything in the missing segment (Pulsar #26230)."""
    bucket, segments = sealed_bucket(7, [(100, 0), (110, 1), (160, 2), (170, 3)], pending=[2, 3])

    def unreadable(bucket_id: int, number: int) -> Segment:
        raise StorageError(f"segment {number} of bucket {bucket_id} is unreadable")

    with pytest.raises(StorageError):
        bucket.activate(pack_key(110, 1), unreadable, {0: segments[0]})
    assert bucket.blocked and bucket.head() == pack_key(160, 0)
    assert bucket.activate(pack_key(110, 1), lambda _bucket_id, number: segments[number]) == pack_key(160, 2)
    assert not bucket.blocked and bucket.head() == pack_key(160, 2)


# -- segments in storage -----------------------------------------------------------------------


def test_segments_respect_max_indexes_and_time_step(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage, max_buckets=100, max_indexes_per_segment=4, time_step_ms=50)
    rng = random.Random(7)
    start = clock.now_ms()
    for i in range(200):
        tracker.add(i, start + 1 + rng.randrange(400))
    meta = storage.load_partition("orders/0")
    assert meta is not None and len(meta.bucket_ids) == tracker.stats().buckets > 5
    for bucket_id in meta.bucket_ids:
        bucket, _ = storage.load_bucket("orders/0", bucket_id)
        assert max(bucket.seg_count) <= 4
        for n in range(bucket.segment_count):
            segment = storage.load_segment("orders/0", bucket_id, n)
            assert len(segment) == bucket.seg_count[n]
            assert segment.deliver_at[-1] - segment.deliver_at[0] < 50
            assert list(segment.deliver_at) == sorted(segment.deliver_at)


def test_delivered_segments_are_dropped_from_storage(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, min_index_count=200, max_buckets=50)
    for i in range(201):
        tracker.add(i, start + 10 + i)
    segments_before = len([k for k in storage.stored_keys() if b"s" in k[-5:-4]])
    clock.advance(110)
    tracker.pop_due(1000)
    tracker.checkpoint(201)
    segments_after = len([k for k in storage.stored_keys() if b"s" in k[-5:-4]])
    assert segments_after < segments_before
    recovered = make_tracker(clock, storage, min_index_count=200, max_buckets=50)
    assert len(recovered) == 201 - 101
    assert [d.offset for d in drain(recovered, clock, start + 400)] == list(range(101, 201))


def test_fully_delivered_buckets_are_deleted(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=50)
    for i in range(100):
        tracker.add(i, start + 10 + i)
    assert tracker.stats().buckets == 9
    clock.advance(200)
    assert len(tracker.pop_due(1000)) == 100
    tracker.checkpoint(100)
    assert tracker.stats().buckets == 0
    assert tracker.stats().snapshot_bytes == 0
    prefix_keys = [k for k in storage.stored_keys() if k.startswith(b"porders/0\x00b")]
    assert prefix_keys == []


def test_fault_on_segment_load_never_skips(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """Pulsar #26230: a message whose segment is not loaded is not skipped, nor is anything after it."""
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=50, retry_interval_ms=100)
    for i in range(40):
        tracker.add(i, start + 10 + (i % 10) * 10 + i // 10)  # buckets interleave in time
    tracker.checkpoint(40)
    clock.advance(200)
    storage.fail("load", 10)
    got = tracker.pop_due(1000)
    assert tracker.degraded
    expected = sorted(Due(start + 10 + (i % 10) * 10 + i // 10, i) for i in range(40))
    assert got == expected[: len(got)] and len(got) < 40
    next_time = tracker.next_delivery_time()
    assert next_time is not None and next_time <= clock.now_ms()
    storage.heal()
    assert tracker.pop_due(1000) == []  # waits for the retry interval
    clock.advance(100)
    got += tracker.pop_due(1000)
    assert got == expected
    assert not tracker.stats().degraded


def test_fault_on_segment_load_at_recovery_is_retried(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage)
    for i in range(30):
        tracker.add(i, start + 10 + i)
    tracker.checkpoint(30)
    storage.fail("load", 1)
    recovered = make_tracker(clock, storage)
    assert len(recovered) == 30
    assert [d.offset for d in drain(recovered, clock, start + 100)] == list(range(30))


def test_loaded_memory_is_bounded(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage, min_index_count=100, max_buckets=5, max_indexes_per_segment=10)
    rng = random.Random(5)
    start = clock.now_ms()
    for i in range(5000):
        tracker.add(i, start + 1 + rng.randrange(10_000))
        stats = tracker.stats()
        assert stats.loaded_indexes <= stats.mutable_indexes + stats.buckets * 10
    # 49 seals of 100: buckets grow to 5, then each 4-way merge takes them to 3, so 3, 4, 5, 3, ...
    assert tracker.stats().buckets == 4 and len(tracker) == 5000
