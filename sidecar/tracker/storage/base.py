"""The snapshot-storage port: everything the bucket tracker asks of durable storage.

The tracker thinks in partitions, buckets, segments and a write-ahead log of its mutable bucket;
an adapter maps them onto a key-value store. Every change the tracker makes (a seal, a merge, a
delete, a checkpoint) is one `SnapshotBatch`, which an adapter applies atomically or not at all,
so a crash never leaves a bucket half written or a bucket list that names a missing bucket.

Positions travel as packed keys, `deliver_at << 64 | offset`: integer order is delivery order
(deliver-at, then offset), which is the order the tracker pops in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

OpKind = Literal["create", "merge", "delete", "checkpoint", "clear", "load", "restore", "sync", "keys"]
"""Operation types, after Pulsar's bucket snapshot metrics (create / load / delete / merge); `restore`
writes an index taken from the state topic, and `sync` makes the writes so far durable."""

KEY_SHIFT = 64
OFFSET_MASK = (1 << KEY_SHIFT) - 1


def pack_key(deliver_at: int, offset: int) -> int:
    return deliver_at << KEY_SHIFT | offset


def unpack_key(key: int) -> tuple[int, int]:
    return key >> KEY_SHIFT, key & OFFSET_MASK


@dataclass(slots=True)
class PartitionMeta:
    """The root record of one partition: which buckets exist and how far the index is durable.

    `delivered_through` is the packed key of the last entry whose pop a checkpoint made durable.
    Pops happen in key order and a new add is always later than anything popped, so every entry
    at or below it has been delivered, in every bucket and in the write-ahead log alike.

    `lineage` names the group commits this state agrees with (CommitMetadata.fingerprint): the
    one its checkpoint was made for, then the one before it. A state that names neither of them
    was overtaken by another member of the group, and is not used (partitions/state.py).
    """

    partition: str
    index_cursor: int | None = None
    delivered_through: int = 0
    bucket_ids: list[int] = field(default_factory=list)
    next_bucket_id: int = 1
    wal_seq: int = 0
    lineage: tuple[str, ...] = ()
    rules: str = ""
    """The intake rules (CommitMetadata's encoding) of the commit point this state was checkpointed
    for: at least once, a restart on state one checkpoint ahead of the group's commit judged the
    records between the two by these, which that commit does not name."""


@dataclass(slots=True)
class BucketMeta:
    """What the tracker keeps in memory about a sealed bucket, without its entries.

    Segments are numbered from 0; those below `first_segment` were fully delivered and deleted.
    The stored bitmap holds the offsets of the bucket's entries later than `bitmap_through`
    (a packed key), so recovery only re-reads the segments between it and the durable delivery
    point to know which offsets are still pending.

    The segment table keeps the first and last deliver-at of each segment but not their offsets:
    a bucket of a week of delays has ~2,000 segments, and every bucket's table stays in memory.
    Deliver-at alone bounds a segment's keys (`min_key`/`max_key`), which is all the tracker
    needs: a bound that is a little loose only makes it load or keep a segment it could skip.
    """

    bucket_id: int
    first_segment: int
    bitmap_through: int
    min_offset: int
    max_offset: int
    seg_min_at: array[int] = field(default_factory=lambda: array("q"))
    seg_max_at: array[int] = field(default_factory=lambda: array("q"))
    seg_count: array[int] = field(default_factory=lambda: array("q"))

    @property
    def segment_count(self) -> int:
        return len(self.seg_count)

    def min_key(self, segment: int) -> int:
        """No key of the segment is lower than this."""
        return self.seg_min_at[segment] << KEY_SHIFT

    def max_key(self, segment: int) -> int:
        """No key of the segment is higher than this."""
        return self.seg_max_at[segment] << KEY_SHIFT | OFFSET_MASK


@dataclass(slots=True)
class Segment:
    """Entries of one segment in key order: two compact columns rather than a tuple per entry."""

    deliver_at: array[int]
    offsets: array[int]

    def __len__(self) -> int:
        return len(self.offsets)


@dataclass(slots=True)
class BucketWrite:
    """A bucket to (re)write: its metadata, its bitmap, and new segments keyed by number."""

    meta: BucketMeta
    bitmap: bytes
    segments: dict[int, Segment] = field(default_factory=dict)


KeyEntry = tuple[int, int | None]
"""A key's newest record: its offset, and its deliver-at (None: nothing of it can be replaced)."""


@dataclass(slots=True)
class SnapshotBatch:
    """One atomic change. Deletes are applied before writes, so a batch may replace a key."""

    kind: OpKind
    partition_meta: PartitionMeta | None = None
    buckets: list[BucketWrite] = field(default_factory=list)
    delete_buckets: list[int] = field(default_factory=list)
    delete_segments: list[tuple[int, int, int]] = field(default_factory=list)
    """(bucket id, first segment, end segment exclusive)."""
    wal_reset: bool = False
    wal_append: tuple[int, Segment] | None = None
    """(chunk sequence number, entries) appended to the write-ahead log."""
    clear_partition: bool = False


class SnapshotStorage(ABC):
    """Durable home of the bucket tracker's index, shared by the trackers of many partitions.

    Every method raises StorageError on failure, with a message that tells the operator what to
    do; the tracker decides whether to retry, degrade, or stop.
    """

    location: str = ""

    @abstractmethod
    def load_partition(self, partition: str) -> PartitionMeta | None:
        """The partition's root record, or None when it has no durable state yet."""

    @abstractmethod
    def load_bucket(self, partition: str, bucket_id: int) -> tuple[BucketMeta, bytes]:
        """A bucket's metadata and its serialized bitmap."""

    @abstractmethod
    def load_segment(self, partition: str, bucket_id: int, segment: int) -> Segment: ...

    @abstractmethod
    def load_segments(self, partition: str, bucket_id: int, first: int, end: int) -> list[Segment]:
        """Segments first..end-1 of a bucket, in one read: a merge reads thousands of small ones."""

    @abstractmethod
    def load_wal(self, partition: str) -> list[Segment]:
        """The write-ahead log chunks of the mutable bucket, oldest first."""

    @abstractmethod
    def load_keys(self, partition: str, keys: list[bytes]) -> list[KeyEntry | None]:
        """Each key's newest record as `write_keys` last wrote it, or None, in one read (a keyed
        topic's slice of intake asks for thousands)."""

    @abstractmethod
    def write_keys(self, partition: str, entries: Mapping[bytes, KeyEntry]) -> None:
        """Keys' newest records (keyed topics), in one write that need not survive a crash: the
        key index is rebuilt from the log whenever a partition starts (tracker/keys.py)."""

    @abstractmethod
    def write(self, partition: str, batch: SnapshotBatch) -> int:
        """Apply a batch atomically; return the number of bytes written."""

    def sync(self) -> None:  # noqa: B027 - a store without a disk has nothing to sync
        """Make every write so far durable against power loss, whichever partition it was for.

        Checkpoints are written without waiting for the disk (kv.SYNCED_KINDS): the caller syncs
        once for all of them, before it commits the inbound offsets they record. Safe to call from
        another thread while writes go on; only the writes made before the call are covered.
        """

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release handles; the data stays."""
