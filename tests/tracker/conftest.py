"""Shared builders for the tracker tests: small buckets and segments, so a few hundred messages
make many buckets, segments and merges."""

from __future__ import annotations

from typing import Any

import pytest
from pyroaring import BitMap64

from sidecar.clock import ManualClock
from sidecar.tracker.base import Due
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.bucket.immutable import ImmutableBucket, cut_segments
from sidecar.tracker.memory import InMemoryTracker
from sidecar.tracker.storage import FakeSnapshotStorage, Segment, SnapshotStorage
from sidecar.tracker.storage.base import pack_key

SMALL: dict[str, Any] = {
    "min_index_count": 10,
    "time_step_ms": 50,
    "max_indexes_per_segment": 4,
    "max_buckets": 4,
    "retries": 1,
    "retry_backoff_s": 0.0,
    "retry_interval_ms": 0,
}


def make_tracker(
    clock: ManualClock, storage: SnapshotStorage, partition: str = "orders/0", **overrides: Any
) -> BucketTracker:
    return BucketTracker(clock, storage, partition, **{**SMALL, **overrides})


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000)


@pytest.fixture
def storage() -> FakeSnapshotStorage:
    return FakeSnapshotStorage()


def drain(tracker: BucketTracker | InMemoryTracker, clock: ManualClock, until: int, step: int = 7) -> list[Due]:
    """Move time forward in steps up to `until`, popping all that is due; check strictness."""
    out: list[Due] = []
    while True:
        batch = tracker.pop_due(1_000_000)
        for due in batch:
            assert due.deliver_at <= clock.now_ms(), "delivered before its deliver-at"
        out.extend(batch)
        if clock.now_ms() >= until:
            return out
        clock.advance(min(step, until - clock.now_ms()))


def ordered(entries: list[Due]) -> bool:
    return entries == sorted(entries)


def sealed_bucket(
    bucket_id: int, entries: list[tuple[int, int]], pending: list[int]
) -> tuple[ImmutableBucket, list[Segment]]:
    """A sealed bucket of (deliver_at, offset) entries, cut in windows of 50 ms, with `pending` not yet popped."""
    segments = cut_segments(sorted(pack_key(at, offset) for at, offset in entries), 50, 10)
    offsets = BitMap64(offset for _, offset in entries)
    bucket, _ = ImmutableBucket.create(
        bucket_id, segments, offsets, offsets.min(), offsets.max(), BitMap64(pending), len(pending)
    )
    return bucket, segments
