"""Shared builders for the tracker tests: small buckets and segments, so a few hundred messages
make many buckets, segments and merges."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.clock import ManualClock
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.storage import FakeSnapshotStorage, SnapshotStorage

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
