"""The key layout and encodings shared by every key-value adapter (RocksDB and the fake).

Keeping one layout for both means the fake exercises the same encoding the real store does, so
a test that passes against the fake is a test of the bytes that end up on disk.

Layout (all integers big-endian so that key order is numeric order):

    FORMAT_KEY                                   the store's format marker (JSON)
    p <partition utf-8> \\0 m                     partition root record (JSON)
    p <partition utf-8> \\0 w <seq:8>             write-ahead log chunk of the mutable bucket
    p <partition utf-8> \\0 b <bucket:8> m        bucket metadata
    p <partition utf-8> \\0 b <bucket:8> x        bucket bitmap (pyroaring serialization)
    p <partition utf-8> \\0 b <bucket:8> s <n:4>  segment n of the bucket
    p <partition utf-8> \\0 k <record key>      a key's newest record (keyed topics): offset, deliver-at

Kafka topic names cannot hold a NUL byte, so the NUL after the partition name keeps the key
ranges of "t/1" and "t/10" apart.
"""

from __future__ import annotations

import json
import struct
import sys
from abc import abstractmethod
from array import array
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from sidecar.errors import StorageError
from sidecar.tracker.storage.base import (
    KEY_SHIFT,
    OFFSET_MASK,
    BucketMeta,
    KeyEntry,
    PartitionMeta,
    Segment,
    SnapshotBatch,
    SnapshotStorage,
)

FORMAT_KEY = b"\x00format"
FORMAT_NAME = "delay-sidecar/bucket-tracker"
FORMAT_VERSION = 2
"""2: bucket metadata without per-segment offset columns. A version-1 state dir is refused with
a message that says to move it aside; the tracker then rebuilds from the committed offsets."""
PARTITION_TAG = b"p"
META_TAG = b"m"
WAL_TAG = b"w"
BUCKET_TAG = b"b"
BUCKET_META_TAG = b"m"
BUCKET_BITMAP_TAG = b"x"
BUCKET_SEGMENT_TAG = b"s"
KEY_TAG = b"k"
_KEY_ENTRY = struct.Struct(">Qq")
"""offset, deliver-at (-1: none): 16 bytes a key."""

_BUCKET_HEADER = struct.Struct(">BQQqQQQI")
_BUCKET_META_VERSION = 2
_META_COLUMNS = 3
_LITTLE = sys.byteorder == "little"

SYNCED_KINDS = frozenset({"clear"})
"""Batches that must reach the disk before write() returns: a clear must not come back.

Every other batch is durable once `sync()` returns. A checkpoint is the one batch whose caller
acts on it (it commits inbound offsets up to the cursor it records), so the caller syncs once,
after all partitions' checkpoints, and commits after that (checkpoint.py). One synced write per
partition cost an fsync each: 0.08 to 0.91 s apiece, on the loop, while the embedded broker and
the payload cache wrote to the same disk (docs/benchmarks.md). A seal, merge or delete only
reorganizes what a checkpoint recorded, with the root record's cursor and delivery point
unchanged, so losing it to a power cut leaves a consistent older state: the store recovers a
prefix of its writes (RocksDB replays its write-ahead log in order)."""

Op = tuple[str, bytes, bytes]
"""("put", key, value), ("del", key, b"") or ("range", start, end): applied in list order."""


def partition_prefix(partition: str) -> bytes:
    if not partition or "\x00" in partition:
        raise ValueError(f"partition key must be non-empty and free of NUL bytes, got {partition!r}")
    return PARTITION_TAG + partition.encode("utf-8") + b"\x00"


def _bucket_prefix(prefix: bytes, bucket_id: int) -> bytes:
    return prefix + BUCKET_TAG + bucket_id.to_bytes(8, "big")


def _segment_key(prefix: bytes, bucket_id: int, segment: int) -> bytes:
    return _bucket_prefix(prefix, bucket_id) + BUCKET_SEGMENT_TAG + segment.to_bytes(4, "big")


def _le(values: array[int]) -> bytes:
    """Columns go to disk little-endian whatever the machine, so a state dir can move hosts."""
    if _LITTLE:
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


def _from_le(typecode: str, data: bytes | memoryview) -> array[int]:
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values


def encode_segment(segment: Segment) -> bytes:
    return _le(segment.deliver_at) + _le(segment.offsets)


def decode_segment(data: bytes) -> Segment:
    if len(data) % 16:
        raise ValueError(f"segment of {len(data)} bytes is not a whole number of entries")
    half = len(data) // 2
    view = memoryview(data)
    if _LITTLE:  # inlined _from_le: a merge decodes thousands of small segments
        at, offsets = array("q"), array("Q")
        at.frombytes(view[:half])
        offsets.frombytes(view[half:])
        return Segment(at, offsets)
    return Segment(_from_le("q", view[:half]), _from_le("Q", view[half:]))


def encode_bucket_meta(meta: BucketMeta) -> bytes:
    through_at, through_offset = meta.bitmap_through >> KEY_SHIFT, meta.bitmap_through & OFFSET_MASK
    header = _BUCKET_HEADER.pack(
        _BUCKET_META_VERSION,
        meta.bucket_id,
        meta.first_segment,
        through_at,
        through_offset,
        meta.min_offset,
        meta.max_offset,
        meta.segment_count,
    )
    return b"".join([header, _le(meta.seg_min_at), _le(meta.seg_max_at), _le(meta.seg_count)])


def decode_bucket_meta(data: bytes) -> BucketMeta:
    version, bucket_id, first, through_at, through_offset, min_offset, max_offset, count = _BUCKET_HEADER.unpack_from(
        data
    )
    if version != _BUCKET_META_VERSION:
        raise ValueError(f"bucket metadata version {version}, expected {_BUCKET_META_VERSION}")
    view = memoryview(data)[_BUCKET_HEADER.size :]
    if len(view) != count * 8 * _META_COLUMNS:
        raise ValueError(f"bucket metadata holds {len(view)} bytes for {count} segments")
    width = count * 8
    cols = [view[i * width : (i + 1) * width] for i in range(_META_COLUMNS)]
    return BucketMeta(
        bucket_id=bucket_id,
        first_segment=first,
        bitmap_through=through_at << KEY_SHIFT | through_offset,
        min_offset=min_offset,
        max_offset=max_offset,
        seg_min_at=_from_le("q", cols[0]),
        seg_max_at=_from_le("q", cols[1]),
        seg_count=_from_le("q", cols[2]),
    )


def encode_partition_meta(meta: PartitionMeta) -> bytes:
    doc: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "partition": meta.partition,
        "index_cursor": meta.index_cursor,
        "delivered_through": [meta.delivered_through >> KEY_SHIFT, meta.delivered_through & OFFSET_MASK],
        "buckets": meta.bucket_ids,
        "next_bucket_id": meta.next_bucket_id,
        "wal_seq": meta.wal_seq,
        "lineage": list(meta.lineage),
    }
    if meta.rules:
        doc["rules"] = meta.rules
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_partition_meta(data: bytes) -> PartitionMeta:
    doc = json.loads(data)
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"partition record version {doc.get('version')!r}, expected {FORMAT_VERSION}")
    at, offset = doc["delivered_through"]
    cursor = doc["index_cursor"]
    if doc.get("runs") not in (None, "[]"):
        # Written with --monotone-runs (removed): the pending runs' members are in no bucket. Without
        # a cursor the index is set aside and rebuilt from the commit, which names those members.
        cursor = None
    return PartitionMeta(
        partition=str(doc["partition"]),
        index_cursor=None if cursor is None else int(cursor),
        delivered_through=int(at) << KEY_SHIFT | int(offset),
        bucket_ids=[int(b) for b in doc["buckets"]],
        next_bucket_id=int(doc["next_bucket_id"]),
        wal_seq=int(doc["wal_seq"]),
        # Written before lineages were kept: agrees with no commit, so the index is rebuilt once.
        lineage=tuple(str(f) for f in doc.get("lineage") or ()),
        rules=str(doc.get("rules") or ""),
    )


def encode_format_marker(owner: str | None) -> bytes:
    return json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "owner": owner}).encode()


class KeyValueSnapshotStorage(SnapshotStorage):
    """SnapshotStorage over any ordered key-value store with atomic batches."""

    @abstractmethod
    def _get(self, key: bytes) -> bytes | None: ...

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """`_get` of each key; a store with a multi-get reads them in one call."""
        return [self._get(key) for key in keys]

    @abstractmethod
    def _scan(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Items with start <= key < end, in key order."""

    @abstractmethod
    def _commit(self, ops: list[Op], sync: bool = True) -> None:
        """Apply ops atomically, in order; with `sync`, durable before returning."""

    @abstractmethod
    def _put_unlogged(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Put the items at once; a crash may lose them even after a later sync (RocksDB: no
        write-ahead log). The key index's entries: thousands a slice, and nothing to recover."""

    def _corrupt(self, what: str, exc: Exception) -> StorageError:
        return StorageError(
            f"{what} in {self.location} is unreadable ({exc}): the state dir is corrupt or was written "
            "by another program. Stop the sidecar, move the state dir aside (keep it for a bug report) "
            "and restart: the tracker then rebuilds from the committed Kafka offsets."
        )

    def _check_marker(self, owner: str | None) -> None:
        """Claim an empty store, or check that a non-empty one is ours (and the caller's)."""
        raw = self._get(FORMAT_KEY)
        if raw is None:
            if next(self._scan(b"", b"\xff" * 16), None) is not None:
                raise StorageError(
                    f"{self.location} holds a RocksDB that was not written by the delay sidecar (no "
                    f"format marker). Point the state dir at an empty or dedicated directory, or move "
                    f"this one away if it is stale."
                )
            self._commit([("put", FORMAT_KEY, encode_format_marker(owner))])
            return
        try:
            marker = json.loads(raw)
            name, version, stored_owner = marker["format"], int(marker["version"]), marker.get("owner")
        except (ValueError, KeyError, TypeError) as exc:
            raise self._corrupt("the format marker", exc) from exc
        if name != FORMAT_NAME:
            raise StorageError(
                f"{self.location} holds data of format {name!r}, not {FORMAT_NAME!r}. Point the state "
                "dir at an empty or dedicated directory."
            )
        if version != FORMAT_VERSION:
            raise StorageError(
                f"{self.location} holds tracker format version {version}; this sidecar reads version "
                f"{FORMAT_VERSION}. Run the sidecar version that wrote it, or move the state dir aside "
                "to rebuild from the committed Kafka offsets."
            )
        if owner is not None and stored_owner is not None and stored_owner != owner:
            raise StorageError(
                f"{self.location} belongs to {stored_owner!r}, not {owner!r}: two sidecars (or two "
                "clusters) must not share a state dir. Give this one its own state dir."
            )

    def load_partition(self, partition: str) -> PartitionMeta | None:
        raw = self._get(partition_prefix(partition) + META_TAG)
        if raw is None:
            return None
        try:
            meta = decode_partition_meta(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise self._corrupt(f"the record of partition {partition!r}", exc) from exc
        if meta.partition != partition:
            raise StorageError(
                f"the record stored for partition {partition!r} in {self.location} names partition "
                f"{meta.partition!r}: the state dir was copied or renamed between partitions. Move it "
                "aside and restart to rebuild from the committed Kafka offsets."
            )
        return meta

    def load_bucket(self, partition: str, bucket_id: int) -> tuple[BucketMeta, bytes]:
        prefix = _bucket_prefix(partition_prefix(partition), bucket_id)
        raw_meta, bitmap = self._get(prefix + BUCKET_META_TAG), self._get(prefix + BUCKET_BITMAP_TAG)
        if raw_meta is None or bitmap is None:
            raise self._corrupt(
                f"bucket {bucket_id} of partition {partition!r}", KeyError("metadata or bitmap missing")
            )
        try:
            meta = decode_bucket_meta(raw_meta)
        except (ValueError, struct.error) as exc:
            raise self._corrupt(f"bucket {bucket_id} of partition {partition!r}", exc) from exc
        return meta, bitmap

    def load_segment(self, partition: str, bucket_id: int, segment: int) -> Segment:
        raw = self._get(_segment_key(partition_prefix(partition), bucket_id, segment))
        what = f"segment {segment} of bucket {bucket_id} of partition {partition!r}"
        if raw is None:
            raise self._corrupt(what, KeyError("missing"))
        try:
            return decode_segment(raw)
        except ValueError as exc:
            raise self._corrupt(what, exc) from exc

    def load_segments(self, partition: str, bucket_id: int, first: int, end: int) -> list[Segment]:
        """One range scan instead of a point read per segment: a merge reads thousands of them."""
        segment_prefix = _bucket_prefix(partition_prefix(partition), bucket_id) + BUCKET_SEGMENT_TAG
        segments: list[Segment] = []
        number = first
        try:
            for key, value in self._scan(
                segment_prefix + first.to_bytes(4, "big"), segment_prefix + end.to_bytes(4, "big")
            ):
                if int.from_bytes(key[-4:], "big") != number:
                    break
                segments.append(decode_segment(value))
                number += 1
        except ValueError as exc:
            what = f"segment {number} of bucket {bucket_id} of partition {partition!r}"
            raise self._corrupt(what, exc) from exc
        if number != end:
            what = f"segment {number} of bucket {bucket_id} of partition {partition!r}"
            raise self._corrupt(what, KeyError("missing"))
        return segments

    def load_wal(self, partition: str) -> list[Segment]:
        start = partition_prefix(partition) + WAL_TAG
        chunks = []
        for _, value in self._scan(start, start[:-1] + bytes([start[-1] + 1])):
            try:
                chunks.append(decode_segment(value))
            except ValueError as exc:
                raise self._corrupt(f"the write-ahead log of partition {partition!r}", exc) from exc
        return chunks

    def load_key(self, partition: str, key: bytes) -> KeyEntry | None:
        """One key's entry (for tests and diagnosis: the sidecar reads a slice's keys at once)."""
        return self.load_keys(partition, [key])[0]

    def load_keys(self, partition: str, keys: list[bytes]) -> list[KeyEntry | None]:
        prefix = partition_prefix(partition) + KEY_TAG
        values = self._get_many([prefix + key for key in keys])
        if values.count(None) == len(values):  # new keys, the common case of a slice: no step each
            return [None] * len(values)
        found: list[KeyEntry | None] = []
        for value in values:
            if value is None:
                found.append(None)
                continue
            try:
                offset, deliver_at = _KEY_ENTRY.unpack(value)
            except struct.error as exc:
                raise self._corrupt(f"the entry of a key of partition {partition!r}", exc) from exc
            found.append((offset, None if deliver_at < 0 else deliver_at))
        return found

    def write_keys(self, partition: str, entries: Mapping[bytes, KeyEntry]) -> None:
        prefix = partition_prefix(partition) + KEY_TAG
        pack = _KEY_ENTRY.pack
        items = entries.items()
        self._put_unlogged((prefix + key, pack(offset, -1 if at is None else at)) for key, (offset, at) in items)

    def write(self, partition: str, batch: SnapshotBatch) -> int:
        self._commit(ops := self._encode(partition_prefix(partition), batch), sync=batch.kind in SYNCED_KINDS)
        return sum(len(op[2]) for op in ops if op[0] == "put")

    @staticmethod
    def _encode(prefix: bytes, batch: SnapshotBatch) -> list[Op]:
        ops: list[Op] = []
        if batch.clear_partition:
            ops.append(("range", prefix, prefix[:-1] + b"\x01"))
        for bucket_id in batch.delete_buckets:
            start = _bucket_prefix(prefix, bucket_id)
            ops.append(("range", start, _bucket_prefix(prefix, bucket_id + 1)))
        for bucket_id, first, end in batch.delete_segments:
            if end > first:
                start_key = _segment_key(prefix, bucket_id, first)
                ops.append(("range", start_key, _segment_key(prefix, bucket_id, end)))
        if batch.wal_reset:
            ops.append(("range", prefix + WAL_TAG, prefix + bytes([WAL_TAG[0] + 1])))
        for write in batch.buckets:
            bucket = _bucket_prefix(prefix, write.meta.bucket_id)
            ops.append(("put", bucket + BUCKET_META_TAG, encode_bucket_meta(write.meta)))
            ops.append(("put", bucket + BUCKET_BITMAP_TAG, write.bitmap))
            # Inlined _segment_key and encode_segment: a bucket of a week of delays has ~2,000 segments.
            segment_prefix = bucket + BUCKET_SEGMENT_TAG
            ops.extend(
                ("put", segment_prefix + number.to_bytes(4, "big"), _le(segment.deliver_at) + _le(segment.offsets))
                for number, segment in write.segments.items()
            )
        if batch.wal_append is not None:
            seq, chunk = batch.wal_append
            ops.append(("put", prefix + WAL_TAG + seq.to_bytes(8, "big"), encode_segment(chunk)))
        if batch.partition_meta is not None:
            ops.append(("put", prefix + META_TAG, encode_partition_meta(batch.partition_meta)))
        return ops
