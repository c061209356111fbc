"""The state topic's records, and a partition's index put back together from them (no Kafka here).

Keys name what they hold, so an operator can read the topic with any console consumer:

    <topic>/<partition>/manifest                    Manifest (JSON)
    <topic>/<partition>/bucket/<id>/meta            a sealed bucket's metadata (the RocksDB encoding)
    <topic>/<partition>/bucket/<id>/segment/<n>     segment n of the bucket (the RocksDB encoding)
    <control topic>/<partition>/nacks/<seq>[/dead]  a control partition's pending nacks (state/journal.py)

A control partition's manifest names its nack chunks where an inbound one names buckets, and its
tail is the control offset up to which they are complete.

A bucket is published as it was sealed or merged, and never rewritten: the local store's later
bitmap rewrites only save recovery time, and the commit's delivered watermark says which of its
entries are done. (A bucket sent again after a restart from local state starts at its first
segment not yet delivered: `first_segment` in its metadata.) Its bitmap is not published either:
a bucket's bitmap is the offsets of its segments, and a merged bucket's can pass Kafka's 1 MB
record limit.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pyroaring import BitMap64

from sidecar.errors import SidecarError
from sidecar.tracker.storage.base import BucketWrite, Segment
from sidecar.tracker.storage.kv import decode_bucket_meta, decode_segment, encode_bucket_meta, encode_segment

MANIFEST_VERSION = 1
Record = tuple[bytes, bytes | None]
"""(key, value) of a state-topic record; a None value is a tombstone."""


class ImageError(SidecarError):
    """The state topic does not hold a complete index for a partition; the log is read again instead."""


@dataclass(frozen=True)
class Manifest:
    """Which sealed buckets make up a partition's index, and where the log must be read again from.

    Every indexed entry with an offset below `tail` is in one of `buckets` (or was delivered); the
    entries from `tail` on are in the mutable bucket or not read yet. `cursor` is the partition's
    next offset when the manifest was written (for operators and logs).
    """

    buckets: tuple[int, ...]
    next_bucket_id: int
    tail: int
    cursor: int

    def encode(self) -> bytes:
        doc = {
            "v": MANIFEST_VERSION,
            "buckets": list(self.buckets),
            "next_bucket_id": self.next_bucket_id,
            "tail": self.tail,
            "cursor": self.cursor,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        """Raises ImageError when `data` is not a manifest this version writes."""
        try:
            doc: Any = json.loads(data)
            if not isinstance(doc, dict) or doc.get("v") != MANIFEST_VERSION:
                raise ValueError(f"version {doc.get('v') if isinstance(doc, dict) else None!r}")
            buckets = tuple(_count(b) for b in doc["buckets"])
            manifest = cls(buckets, _count(doc["next_bucket_id"]), _count(doc["tail"]), _count(doc["cursor"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ImageError(f"the manifest is unreadable ({exc})") from exc
        if any(b >= manifest.next_bucket_id for b in buckets) or len(set(buckets)) != len(buckets):
            raise ImageError("the manifest names a bucket id twice, or one at or above its next bucket id")
        return manifest


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def manifest_key(partition: str) -> bytes:
    return f"{partition}/manifest".encode()


def rules_key(partition: str, ref: str) -> bytes:
    """A partition's whole intake-rule history, by content (CommitMetadata.spill)."""
    return f"{partition}/rules/{ref}".encode()


def _bucket_key(partition: str, bucket_id: int) -> str:
    return f"{partition}/bucket/{bucket_id}"


def bucket_records(partition: str, write: BucketWrite) -> list[Record]:
    """A sealed or merged bucket, as records: its segments first, its metadata last."""
    prefix = _bucket_key(partition, write.meta.bucket_id)
    records: list[Record] = [
        (f"{prefix}/segment/{n}".encode(), encode_segment(segment)) for n, segment in sorted(write.segments.items())
    ]
    records.append((f"{prefix}/meta".encode(), encode_bucket_meta(write.meta)))
    return records


def bucket_tombstones(partition: str, bucket_id: int, segment_count: int) -> list[Record]:
    """Tombstones for every record of a deleted bucket, so compaction drops them."""
    prefix = _bucket_key(partition, bucket_id)
    keys = [f"{prefix}/meta", *(f"{prefix}/segment/{n}" for n in range(segment_count))]
    return [(key.encode(), None) for key in keys]


@dataclass
class PartitionImage:
    """The latest value of every state record of one partition, as read from the state topic."""

    partition: str
    values: dict[bytes, bytes] = field(default_factory=dict)

    def take(self, key: bytes, value: bytes | None) -> None:
        if value is None:
            self.values.pop(key, None)
        else:
            self.values[key] = value

    def bucket_keys(self) -> list[bytes]:
        prefix = f"{self.partition}/bucket/".encode()
        return [key for key in self.values if key.startswith(prefix)]

    def first_free_bucket_id(self) -> int:
        """A bucket id above every one a record or the manifest names, for an index started afresh:
        its buckets must not overwrite those an older manifest may still name."""
        prefix = f"{self.partition}/bucket/".encode()
        ids = [int(key[len(prefix) :].split(b"/", 1)[0]) for key in self.bucket_keys()]
        try:
            manifest = self.manifest()
        except ImageError:
            manifest = None
        return max(max(ids, default=0) + 1, manifest.next_bucket_id if manifest is not None else 1)

    def manifest(self) -> Manifest | None:
        raw = self.values.get(manifest_key(self.partition))
        return None if raw is None else Manifest.decode(raw)

    def buckets(self, manifest: Manifest) -> list[BucketWrite]:
        """The manifest's buckets, whole, as writes for the local store; ImageError if one is incomplete."""
        return [self._bucket(bucket_id) for bucket_id in manifest.buckets]

    def _bucket(self, bucket_id: int) -> BucketWrite:
        prefix = _bucket_key(self.partition, bucket_id)
        raw = self.values.get(f"{prefix}/meta".encode())
        if raw is None:
            raise ImageError(f"bucket {bucket_id} is named by the manifest but missing")
        try:
            meta = decode_bucket_meta(raw)
        except (ValueError, struct.error) as exc:
            raise ImageError(f"the metadata of bucket {bucket_id} is unreadable ({exc})") from exc
        if meta.bucket_id != bucket_id or meta.first_segment > meta.segment_count:
            raise ImageError(f"the metadata of bucket {bucket_id} does not describe bucket {bucket_id}")
        segments: dict[int, Segment] = {}
        bitmap = BitMap64()
        for n in range(meta.first_segment, meta.segment_count):
            data = self.values.get(f"{prefix}/segment/{n}".encode())
            if data is None:
                raise ImageError(f"segment {n} of bucket {bucket_id} is missing")
            try:
                segment = decode_segment(data)
            except ValueError as exc:
                raise ImageError(f"segment {n} of bucket {bucket_id} is unreadable ({exc})") from exc
            if len(segment) != meta.seg_count[n]:
                count = meta.seg_count[n]
                raise ImageError(f"segment {n} of bucket {bucket_id} holds {len(segment)} entries, not {count}")
            segments[n] = segment
            bitmap.update(segment.offsets)
        if segments and (bitmap.min() < meta.min_offset or bitmap.max() > meta.max_offset):
            raise ImageError(f"bucket {bucket_id} holds offsets outside its range")
        bitmap.run_optimize()
        return BucketWrite(replace(meta, bitmap_through=0), bitmap.serialize(), segments)


def image_of(partition: str, records: Iterable[Record]) -> PartitionImage:
    """The image of `partition` from records read in offset order (other partitions' are skipped)."""
    image = PartitionImage(partition)
    prefix = f"{partition}/".encode()
    for key, value in records:
        if key.startswith(prefix):
            image.take(key, value)
    return image
