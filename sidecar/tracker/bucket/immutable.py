"""The sealed (immutable) bucket: its segments on disk, one loaded at a time, and its snapshot format.

A sealed bucket is written once, by a seal or a merge, and from then on only read and deleted.
Memory holds its segment table, its pending bitmap and one loaded segment, whatever its size:
that is what bounds the tracker's memory (Pulsar's ImmutableBucket).

Segments are cut on epoch-aligned windows of `time_step_ms`, so segments of different buckets
covering the same window can be merged window by window, with bounded memory.
"""

from __future__ import annotations

import dataclasses
from array import array
from bisect import bisect_left
from collections.abc import Callable
from typing import TypeAlias

from pyroaring import BitMap64

from sidecar.errors import StorageError
from sidecar.tracker.storage.base import KEY_SHIFT, OFFSET_MASK, BucketMeta, BucketWrite, Segment

_SHIFT = KEY_SHIFT
_MASK = OFFSET_MASK
_ENTRY_BYTES = 16
NO_KEY = 1 << 256
"""Later than any packed key: the head of an empty source."""

SegmentLoader: TypeAlias = Callable[[int, int], Segment]
"""Reads segment `number` of bucket `bucket_id`: (bucket_id, number) -> Segment, retried by the caller."""


def cut_segments(keys: list[int], step: int, max_per_segment: int) -> list[Segment]:
    """Cut sorted keys into segments of one time window each, at most max_per_segment long.

    The columns are built once and sliced per segment (slicing an array is a copy in C): a
    week of delays makes ~2,000 segments of a few entries each, where a per-segment build
    would cost a Python loop per segment.
    """
    at = array("q", [k >> _SHIFT for k in keys])
    offsets = array("Q", [k & _MASK for k in keys])
    segments: list[Segment] = []
    n, i = len(keys), 0
    while i < n:
        end = bisect_left(at, (at[i] // step + 1) * step, i)
        while i < end:
            j = min(i + max_per_segment, end)
            segments.append(Segment(at[i:j], offsets[i:j]))
            i = j
    return segments


def latest_per_offset(keys: list[int], pending: BitMap64) -> list[int]:
    """Popped-but-not-durable keys to keep in a snapshot, in key order.

    An offset is kept once at most, and not at all when it is pending again (re-added after its
    pop): the re-add supersedes the pop, and a bucket never holds one offset twice, which is what
    lets its bitmap count its entries.
    """
    seen: set[int] = set()
    kept: list[int] = []
    for key in reversed(keys):
        offset = key & _MASK
        if offset not in pending and offset not in seen:
            seen.add(offset)
            kept.append(key)
    kept.reverse()
    return kept


class ImmutableBucket:
    """A sealed bucket in memory: its segment table, pending bitmap and one loaded segment.

    The tracker's pop loop reads and advances `at`, `offsets`, `pos`, `bitmap` and `pending`
    directly, as it does the mutable bucket's columns: a method call per popped entry would
    cost more than the pop itself.
    """

    __slots__ = (
        "at",
        "bitmap",
        "bitmap_bytes",
        "blocked",
        "bucket_id",
        "meta",
        "offsets",
        "pending",
        "popped_since_bitmap",
        "pos",
        "segment",
        "stored",
    )

    def __init__(self, meta: BucketMeta, bitmap: BitMap64, pending: int, bitmap_bytes: int) -> None:
        self.meta = meta
        self.bucket_id = meta.bucket_id
        self.bitmap = bitmap
        self.pending = pending
        self.bitmap_bytes = bitmap_bytes
        self.segment = meta.first_segment
        self.at: array[int] = array("q")
        self.offsets: array[int] = array("Q")
        self.pos = 0
        self.blocked = False
        self.popped_since_bitmap = 0
        self.stored = sum(meta.seg_count[meta.first_segment :])
        """Entries in the stored segments, delivered or not: what a bitmap rewrite is weighed by."""

    @classmethod
    def create(
        cls,
        bucket_id: int,
        segments: list[Segment],
        stored: BitMap64,
        min_offset: int,
        max_offset: int,
        pending: BitMap64,
        pending_count: int,
    ) -> tuple[ImmutableBucket, BucketWrite]:
        """A new bucket of `segments`, and the write that stores it.

        The stored bitmap holds every offset of the segments, popped ones included: recovery
        removes what is delivered by the durable delivery point. `pending` is the bitmap kept in
        memory, without pops that are not durable yet. Both come run-optimized.
        """
        raw_bitmap = stored.serialize()
        meta = BucketMeta(
            bucket_id=bucket_id,
            first_segment=0,
            bitmap_through=0,
            min_offset=min_offset,
            max_offset=max_offset,
            seg_min_at=array("q", [s.deliver_at[0] for s in segments]),
            seg_max_at=array("q", [s.deliver_at[-1] for s in segments]),
            seg_count=array("q", [len(s) for s in segments]),
        )
        write = BucketWrite(meta, raw_bitmap, dict(enumerate(segments)))
        return cls(meta, pending, pending_count, len(raw_bitmap)), write

    @classmethod
    def recover(
        cls, meta: BucketMeta, bitmap: BitMap64, bitmap_bytes: int, through: int, load: SegmentLoader
    ) -> ImmutableBucket:
        """The bucket as a restart finds it, with everything up to `through` delivered.

        The stored bitmap still holds what was popped after `bitmap_through`, so the segments
        between it and the durable delivery point `through` are read to drop those offsets.
        Raises StorageError when a segment cannot be read.
        """
        bucket = cls(meta, bitmap, 0, bitmap_bytes)
        loaded: dict[int, Segment] = {}
        for number in range(meta.first_segment, meta.segment_count):
            if meta.min_key(number) > through:
                break
            if meta.max_key(number) <= meta.bitmap_through:
                continue
            segment = load(bucket.bucket_id, number)
            loaded[number] = segment
            for d, o in zip(segment.deliver_at, segment.offsets, strict=True):
                if d << _SHIFT | o <= through:
                    bitmap.discard(o)
        bitmap.run_optimize()
        bucket.pending = len(bitmap)
        bucket.activate(through, load, loaded)
        return bucket

    def head(self) -> int:
        if self.blocked:
            # A barrier no later than anything in the missing segment.
            return self.meta.min_key(self.segment)
        if self.pos < len(self.offsets):
            return self.at[self.pos] << _SHIFT | self.offsets[self.pos]
        return NO_KEY

    @property
    def snapshot_bytes(self) -> int:
        return self.stored * _ENTRY_BYTES + self.bitmap_bytes

    def activate(self, popped: int, load: SegmentLoader, preloaded: dict[int, Segment] | None = None) -> int:
        """Load the current segment, skipping entries up to `popped`; return the head key.

        Moves on to the next segment when one holds nothing pending. On a failed load the
        bucket is blocked: its head becomes the first key of the missing segment, so nothing
        later is popped before the segment is loaded. Raises StorageError in that case.
        """
        meta = self.meta
        while self.segment < meta.segment_count:
            number = self.segment
            if meta.max_key(number) <= popped:
                self.segment += 1
                continue
            segment = preloaded.get(number) if preloaded is not None else None
            if segment is None:
                try:
                    segment = load(self.bucket_id, number)
                except StorageError:
                    self.blocked = True
                    self.at, self.offsets, self.pos = array("q"), array("Q"), 0
                    raise
            at, offsets, pos, n = segment.deliver_at, segment.offsets, 0, len(segment)
            while pos < n and (at[pos] << _SHIFT | offsets[pos]) <= popped:
                pos += 1
            self.blocked = False
            self.at, self.offsets, self.pos = at, offsets, pos
            if pos < n:
                return at[pos] << _SHIFT | offsets[pos]
            self.segment += 1
        self.blocked = False
        self.at, self.offsets, self.pos = array("q"), array("Q"), 0
        return NO_KEY

    def needs_bitmap_rewrite(self, ratio: float) -> bool:
        """Whether enough was popped since the stored bitmap that recovery should not redo it.

        Rewriting costs the bitmap; not rewriting costs recovery a read of every segment popped
        since, so the bitmap is rewritten once the pops pass `ratio` of the stored entries.
        """
        return bool(self.pending) and self.popped_since_bitmap > ratio * self.stored

    def bitmap_write(self, delivered_through: int) -> BucketWrite:
        """The write that stores the pending bitmap as of `delivered_through` and drops delivered segments."""
        meta = dataclasses.replace(self.meta, first_segment=self.segment, bitmap_through=delivered_through)
        self.bitmap.run_optimize()
        return BucketWrite(meta, self.bitmap.serialize())

    def bitmap_written(self, write: BucketWrite) -> None:
        """Take the metadata of a `bitmap_write` that storage committed."""
        meta = write.meta
        self.meta, self.bitmap_bytes, self.popped_since_bitmap = meta, len(write.bitmap), 0
        self.stored = sum(meta.seg_count[meta.first_segment :])
