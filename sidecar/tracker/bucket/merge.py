"""Merging sealed buckets: which run of buckets to merge, and the merged bucket they make.

Over max_buckets, each seal adds one bucket, so adjacent buckets are merged into one, as in
Pulsar. A merge rewrites every entry later than the durable delivery point, popped ones that a
checkpoint has not made durable included: a merge must not turn a pop into a loss (Pulsar
#26251 lost whole segments here). Segments are merged window by window, and read a chunk at a
time, so memory holds the merged bucket but not every source too.

This module only reads storage; the tracker writes the merged bucket and swaps it in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pyroaring import BitMap64

from sidecar.tracker.bucket.immutable import ImmutableBucket, cut_segments, latest_per_offset
from sidecar.tracker.storage.base import KEY_SHIFT, BucketWrite, Segment

_SHIFT = KEY_SHIFT
_MAX_MERGE = 4
"""Buckets merged at once at most, as in Pulsar. Over max_buckets, each seal adds one bucket; a
4-way merge takes a third as many merges as a 2-way one and, being a flatter merge tree, rewrites
each entry about half as often (10M messages over a week: 10.5M entries rewritten instead of
21.4M, 50 merges instead of 150)."""
_CUT_BATCH = 4096
"""Merged keys gathered before they are cut into segments."""
_READ_CHUNK = 256
"""Segments a merge reads per storage call: one range scan instead of a point read per segment,
with memory bounded by the chunk rather than the bucket."""

SegmentsLoader = Callable[[int, int, int], list[Segment]]
"""Reads segments first..end-1 of a bucket: (bucket_id, first, end) -> segments, retried by the caller."""


class _SegmentReader:
    """Reads a source bucket's segments for a merge, in number order, a chunk per storage call."""

    __slots__ = ("_bucket_id", "_buffer", "_end", "_load")

    def __init__(self, load: SegmentsLoader, bucket: ImmutableBucket) -> None:
        self._load = load
        self._bucket_id = bucket.bucket_id
        self._end = bucket.meta.segment_count
        self._buffer: dict[int, Segment] = {}

    def get(self, number: int, keep: bool = False) -> Segment:
        """Segment `number`; dropped from the buffer unless `keep` (it is read again later)."""
        segment = self._buffer.get(number) if keep else self._buffer.pop(number, None)
        if segment is None:
            stop = min(number + _READ_CHUNK, self._end)
            self._buffer = dict(zip(range(number, stop), self._load(self._bucket_id, number, stop), strict=True))
            segment = self._buffer[number] if keep else self._buffer.pop(number)
        return segment


def _keys(segment: Segment) -> list[int]:
    return [d << _SHIFT | o for d, o in zip(segment.deliver_at, segment.offsets, strict=True)]


def best_run(buckets: Sequence[ImmutableBucket]) -> tuple[int, int]:
    """(index, width) of the adjacent buckets to merge next, after Pulsar's selectMergedBuckets.

    Up to _MAX_MERGE buckets, fewest pending messages first, then the earliest next entry.
    Never all of them (unless there are only two): with max_buckets at 1 to 3, merging every
    bucket would rewrite the whole index at each seal, where leaving one out lets the choice
    skip the largest.
    """
    width = max(2, min(_MAX_MERGE, len(buckets) - 1))
    return min(
        range(len(buckets) - width + 1),
        key=lambda i: (
            sum(b.pending for b in buckets[i : i + width]),
            min(b.head() for b in buckets[i : i + width]),
        ),
    ), width


def merge_buckets(
    sources: Sequence[ImmutableBucket],
    bucket_id: int,
    *,
    durable: int,
    popped: int,
    step: int,
    max_per_segment: int,
    load: SegmentsLoader,
) -> tuple[ImmutableBucket, BucketWrite] | None:
    """The bucket that replaces `sources`, and its write; None when nothing in them is left to keep.

    `durable` is the delivery point a checkpoint made durable and `popped` the one in memory:
    entries up to `durable` are dropped, entries between the two are kept (once per offset, and
    not at all when the offset is pending again). Raises StorageError when a read fails.
    """
    readers = [_SegmentReader(load, bucket) for bucket in sources]

    windows: dict[int, list[tuple[int, int]]] = {}
    """Window -> (source, segment number), in segment order within each source."""
    for source, bucket in enumerate(sources):
        meta = bucket.meta
        for number in range(meta.first_segment, meta.segment_count):
            if meta.max_key(number) > durable:
                windows.setdefault(meta.seg_min_at[number] // step, []).append((source, number))
    pending = BitMap64.union(*(b.bitmap for b in sources))
    drop: set[int] = set()
    if popped > durable:
        undelivered: list[int] = []
        for source, bucket in enumerate(sources):
            meta = bucket.meta
            for number in range(meta.first_segment, meta.segment_count):
                if meta.max_key(number) <= durable:
                    continue
                if meta.min_key(number) > popped:
                    break
                segment = readers[source].get(number, keep=True)
                undelivered.extend(k for k in _keys(segment) if durable < k <= popped)
        undelivered.sort()
        drop = set(undelivered) - set(latest_per_offset(undelivered, pending))
    segments: list[Segment] = []
    stored = BitMap64()
    merged_keys: list[int] = []
    """Merged windows not cut yet: windows come in order, so their keys join in order, and
    cutting a few thousand at once saves a call per window (thousands per merge)."""
    for position, window in enumerate(sorted_windows := sorted(windows)):
        keys: list[int] = []
        for source, number in windows[window]:
            segment = readers[source].get(number)
            keys += [d << _SHIFT | o for d, o in zip(segment.deliver_at, segment.offsets, strict=True)]
        keys.sort()
        if keys and keys[0] <= popped:
            keys = [k for k in keys if k > durable and k not in drop]
        merged_keys += keys
        if len(merged_keys) >= _CUT_BATCH or position == len(sorted_windows) - 1:
            for segment in cut_segments(merged_keys, step, max_per_segment):
                stored.update(segment.offsets)
                segments.append(segment)
            merged_keys = []
    if not segments:
        return None
    stored.run_optimize()
    pending.run_optimize()
    return ImmutableBucket.create(
        bucket_id,
        segments,
        stored,
        min(b.meta.min_offset for b in sources),
        max(b.meta.max_offset for b in sources),
        pending,
        sum(b.pending for b in sources),
    )
