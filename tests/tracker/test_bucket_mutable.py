"""The mutable bucket: its write-ahead log, and the seal that turns it into a sealed bucket."""

from __future__ import annotations

import random
from array import array

import pytest

from sidecar.clock import ManualClock
from sidecar.tracker.base import Due
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.bucket.mutable import MutableBucket
from sidecar.tracker.storage import FakeSnapshotStorage, Segment
from sidecar.tracker.storage.base import pack_key

from .conftest import drain, make_tracker


def test_the_log_is_rewritten_with_what_is_pending_once_it_is_mostly_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sidecar.tracker.bucket.mutable._WAL_COMPACT_MIN", 2)
    log = [Segment(array("q", [10, 20, 30, 40, 50, 60]), array("Q", range(6)))]
    mostly_pending = MutableBucket()
    mostly_pending.recover(log, through=pack_key(10, 0))
    assert mostly_pending.count == 5 and mostly_pending.wal_stored == 6
    assert mostly_pending.wal_chunk() == (None, False, 6)  # nothing new to append
    mostly_delivered = MutableBucket()
    mostly_delivered.recover(log, through=pack_key(50, 4))
    chunk, replaces_log, stored = mostly_delivered.wal_chunk()
    assert chunk is not None and replaces_log and stored == 1
    assert (list(chunk.deliver_at), list(chunk.offsets)) == ([60], [5])


def test_crash_after_checkpoint_loses_nothing_from_mutable_bucket(
    clock: ManualClock, storage: FakeSnapshotStorage
) -> None:
    tracker = make_tracker(clock, storage, min_index_count=1000)
    start = clock.now_ms()
    for i in range(30):
        tracker.add(i, start + 50 + (i * 37) % 100)
    tracker.checkpoint(30)
    assert tracker.stats().buckets == 0
    recovered = make_tracker(clock, storage, min_index_count=1000)
    assert len(recovered) == 30
    expected = sorted(Due(start + 50 + (i * 37) % 100, i) for i in range(30))
    assert drain(recovered, clock, start + 200) == expected


def test_re_add_after_pop_before_checkpoint_is_not_duplicated(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=1)
    for i in range(30):
        tracker.add(i, start + 10 + i)
    clock.advance(20)
    popped = tracker.pop_due(1000)
    for due in popped:
        tracker.add(due.offset, start + 500 + due.offset)  # re-added before any checkpoint
    for i in range(30, 60):
        tracker.add(i, start + 100 + i)  # more seals and merges
    tracker.checkpoint(60)
    recovered = make_tracker(clock, storage, max_buckets=1)
    out = drain(recovered, clock, start + 1000)
    assert sorted(d.offset for d in out) == list(range(60))
    assert len(recovered) == 0


def test_sealing_50k_entries_makes_one_bucket(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """How long a seal takes (Pulsar #24603 took 1.5 s) is measured by bench/bench_tracker.py, not here."""
    tracker = BucketTracker(clock, storage, "t/0", retry_backoff_s=0)
    rng = random.Random(1)
    start = clock.now_ms()
    for i in range(50_000):
        tracker.add(i, start + 1 + rng.randrange(7 * 86_400_000))
    assert tracker.seal()
    assert tracker.stats().buckets == 1 and len(tracker) == 50_000
