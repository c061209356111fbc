"""Snapshot storage of the bucket tracker: the port, a RocksDB adapter and a fake for tests."""

from sidecar.tracker.storage.base import (
    BucketMeta,
    BucketWrite,
    OpKind,
    PartitionMeta,
    Segment,
    SnapshotBatch,
    SnapshotStorage,
)
from sidecar.tracker.storage.fake import FakeSnapshotStorage
from sidecar.tracker.storage.rocksdb import RocksDbSnapshotStorage

__all__ = [
    "BucketMeta",
    "BucketWrite",
    "FakeSnapshotStorage",
    "OpKind",
    "PartitionMeta",
    "RocksDbSnapshotStorage",
    "Segment",
    "SnapshotBatch",
    "SnapshotStorage",
]
