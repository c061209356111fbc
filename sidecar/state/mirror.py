"""The local snapshot store, mirrored to the state topic: RocksDB becomes a cache of Kafka.

Every bucket the bucket tracker seals or merges is queued here as state-topic records, and every
bucket it deletes as tombstones. Nothing is sent from here: the checkpoint sends what is queued,
with the partition's manifest (state/topic.py), so in exactly-once mode the snapshots join the
transaction that commits the offsets they cover.

Records are queued per bucket, and a bucket deleted before it was ever sent (sealed, then merged
within one checkpoint) is simply dropped from the queue.
"""

from __future__ import annotations

from collections.abc import Mapping

from sidecar.state.image import Record, bucket_records, bucket_tombstones
from sidecar.tracker.storage.base import (
    BucketMeta,
    BucketWrite,
    KeyEntry,
    PartitionMeta,
    Segment,
    SnapshotBatch,
    SnapshotStorage,
)

MIRRORED_KINDS = frozenset({"create", "merge"})
"""Batches that make a new bucket. A checkpoint's bitmap rewrite only saves recovery time locally,
and a restore writes what came from the state topic."""


class _Outbox:
    def __init__(self) -> None:
        self.buckets: dict[int, list[Record]] = {}
        self.tombstones: list[Record] = []
        self.sent: set[int] = set()
        """Bucket ids the state topic holds (or will, once what was taken is acknowledged)."""


class MirroredStorage(SnapshotStorage):
    def __init__(self, local: SnapshotStorage) -> None:
        self.local = local
        self.location = local.location
        self._outboxes: dict[str, _Outbox] = {}

    # -- the storage port: reads go to the local store ---------------------------------------

    def load_partition(self, partition: str) -> PartitionMeta | None:
        return self.local.load_partition(partition)

    def load_bucket(self, partition: str, bucket_id: int) -> tuple[BucketMeta, bytes]:
        return self.local.load_bucket(partition, bucket_id)

    def load_segment(self, partition: str, bucket_id: int, segment: int) -> Segment:
        return self.local.load_segment(partition, bucket_id, segment)

    def load_segments(self, partition: str, bucket_id: int, first: int, end: int) -> list[Segment]:
        return self.local.load_segments(partition, bucket_id, first, end)

    def load_wal(self, partition: str) -> list[Segment]:
        return self.local.load_wal(partition)

    def load_keys(self, partition: str, keys: list[bytes]) -> list[KeyEntry | None]:
        return self.local.load_keys(partition, keys)

    def write_keys(self, partition: str, entries: Mapping[bytes, KeyEntry]) -> None:
        """Not mirrored: a keyed partition's next owner reads its log again (tracker/keys.py)."""
        self.local.write_keys(partition, entries)

    def write(self, partition: str, batch: SnapshotBatch) -> int:
        outbox = self._outboxes.setdefault(partition, _Outbox())
        tombstones: list[Record] = []
        for bucket_id in batch.delete_buckets:
            if bucket_id not in outbox.buckets:  # read before the delete: how many segments to tombstone
                meta, _ = self.local.load_bucket(partition, bucket_id)
                tombstones += bucket_tombstones(partition, bucket_id, meta.segment_count)
        written = self.local.write(partition, batch)
        if batch.clear_partition:
            self._outboxes[partition] = outbox = _Outbox()  # local state discarded: what it queued goes too
        for bucket_id in batch.delete_buckets:
            outbox.buckets.pop(bucket_id, None)
            outbox.sent.discard(bucket_id)
        outbox.tombstones += tombstones
        if batch.kind in MIRRORED_KINDS:
            for bucket in batch.buckets:
                outbox.buckets[bucket.meta.bucket_id] = bucket_records(partition, bucket)
        return written

    def sync(self) -> None:
        self.local.sync()

    def close(self) -> None:
        self.local.close()

    # -- what the checkpoint sends ------------------------------------------------------------

    def take(self, partition: str, live: tuple[int, ...]) -> tuple[list[Record], list[Record]]:
        """(bucket records, tombstones) to send for `partition`, whose live buckets are `live`.

        A live bucket that was never sent from this process (the sidecar restarted from its local
        state) is read back from the local store and sent again, whole: the state topic may not
        have it, since a crash can come between a seal and the next checkpoint.
        """
        outbox = self._outboxes.setdefault(partition, _Outbox())
        records: list[Record] = []
        for bucket_id in live:
            queued = outbox.buckets.pop(bucket_id, None)
            if queued is None and bucket_id not in outbox.sent:
                queued = self._stored(partition, bucket_id)
            if queued is not None:
                records += queued
                outbox.sent.add(bucket_id)
        tombstones, outbox.tombstones = outbox.tombstones, []
        return records, tombstones

    def reset(self) -> None:
        """A new engine starts: what the last one sent may have been purged or aborted with it, so
        every live bucket is sent again at its partition's next checkpoint. (Tombstones it took are
        not: a bucket no manifest names is only space until compaction.)"""
        for outbox in self._outboxes.values():
            outbox.sent.clear()

    def adopt(self, partition: str, bucket_ids: list[int]) -> None:
        """The state topic already holds these buckets: the index was restored from them."""
        self._outboxes[partition] = outbox = _Outbox()
        outbox.sent.update(bucket_ids)

    def drop_later(self, partition: str, keys: list[bytes]) -> None:
        """Tombstone these records after the partition's next manifest: an index that was not usable
        (the log is read again instead) would otherwise stay in a compacted topic for ever."""
        self._outboxes.setdefault(partition, _Outbox()).tombstones += [(key, None) for key in keys]

    def forget(self, partition: str) -> None:
        """The partition went to another member: what it queued is the new owner's to write."""
        self._outboxes.pop(partition, None)

    def _stored(self, partition: str, bucket_id: int) -> list[Record]:
        meta, _ = self.local.load_bucket(partition, bucket_id)
        first = meta.first_segment  # segments below it were delivered and deleted locally
        segments = self.local.load_segments(partition, bucket_id, first, meta.segment_count)
        write = BucketWrite(meta, b"", {first + i: segment for i, segment in enumerate(segments)})
        return bucket_records(partition, write)
