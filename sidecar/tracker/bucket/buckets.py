"""The partition's sealed buckets together: the list, the shared queue of their heads, and the
changes that concern them alone (recovery, merges, deletes).

Seals and checkpoints also change the write-ahead log of the mutable bucket, so the tracker
writes those batches itself and hands a new bucket over with `add`.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import time

from sidecar.clock import Clock
from sidecar.errors import StorageError
from sidecar.tracker.bucket.immutable import NO_KEY, ImmutableBucket
from sidecar.tracker.bucket.merge import best_run, merge_buckets
from sidecar.tracker.bucket.store import PartitionStore, release_memory
from sidecar.tracker.storage.base import KEY_SHIFT, OFFSET_MASK, Segment, SnapshotBatch

_SHIFT = KEY_SHIFT
_MASK = OFFSET_MASK


class SealedBuckets:
    """Sealed buckets in the order they were sealed; a merged bucket takes the place of its sources.

    `heap` is the shared queue: (head key, bucket id) of every bucket with something left to
    pop, or the barrier key of a bucket whose segment failed to load. The tracker's pop loop
    reads it and `by_id` directly.
    """

    def __init__(
        self,
        store: PartitionStore,
        clock: Clock,
        logger: logging.Logger,
        *,
        step: int,
        max_per_segment: int,
        max_buckets: int,
    ) -> None:
        self._store = store
        self._clock = clock
        self._logger = logger
        self._step = step
        self._max_per_segment = max_per_segment
        self._max_buckets = max_buckets
        self.reset()

    def reset(self) -> None:
        self.buckets: list[ImmutableBucket] = []
        self.by_id: dict[int, ImmutableBucket] = {}
        self.heap: list[tuple[int, int]] = []

    def ids(self) -> list[int]:
        return [b.bucket_id for b in self.buckets]

    def recover(self, bucket_ids: list[int], through: int) -> None:
        """Load the buckets the root record names, with everything up to `through` delivered."""
        for bucket_id in bucket_ids:
            meta, bitmap, bitmap_bytes = self._store.load_bucket(bucket_id)
            bucket = ImmutableBucket.recover(meta, bitmap, bitmap_bytes, through, self._store.load_segment)
            self.buckets.append(bucket)
            self.by_id[bucket_id] = bucket
        self.rebuild_heap()

    def add(self, bucket: ImmutableBucket, segments: dict[int, Segment], popped: int) -> None:
        """Take a bucket that storage now holds, with its segments still in memory."""
        head = bucket.activate(popped, self._store.load_segment, segments)
        self.buckets.append(bucket)
        self.by_id[bucket.bucket_id] = bucket
        if head != NO_KEY:
            heapq.heappush(self.heap, (head, bucket.bucket_id))

    def rebuild_heap(self) -> None:
        self.heap = [(head, b.bucket_id) for b in self.buckets if (head := b.head()) != NO_KEY]
        heapq.heapify(self.heap)

    def replace_head(self, bucket: ImmutableBucket, head: int) -> None:
        """Replace the heap top, which belongs to `bucket`, by its new head (or drop it)."""
        if head == NO_KEY:
            heapq.heappop(self.heap)
        else:
            heapq.heapreplace(self.heap, (head, bucket.bucket_id))

    def peek_loaded(self, low: int, limit: int, found: list[int]) -> None:
        """Append to `found` the keys of the loaded segments above `low` and below `limit`.

        Bisected on the deliver-at column: the read-ahead asks for the next second beyond what it
        has seen, and a pass from each segment's pop position went through up to ten seconds of
        entries it had seen already (20 to 50 ms a call in the delayed bench)."""
        low_at, low_offset = low >> _SHIFT, low & _MASK
        limit_at = limit >> _SHIFT
        for bucket in self.buckets:
            at, offsets, end = bucket.at, bucket.offsets, len(bucket.offsets)
            start = bucket.pos
            if low >= 0:
                start = bisect.bisect_left(at, low_at, start, end)
                while start < end and at[start] == low_at and offsets[start] <= low_offset:
                    start += 1
            stop = bisect.bisect_left(at, limit_at, start, end)
            while stop < end and (at[stop] << _SHIFT | offsets[stop]) < limit:
                stop += 1
            if stop > start:
                found += [a << _SHIFT | o for a, o in zip(at[start:stop], offsets[start:stop], strict=True)]

    # -- deletes ----------------------------------------------------------------------------

    def delete_delivered(self) -> None:
        """Delete the fully delivered buckets, once a checkpoint made their pops durable."""
        for bucket in [b for b in self.buckets if not b.pending]:
            if not self._delete(bucket):
                break

    def _delete(self, bucket: ImmutableBucket) -> bool:
        ids = [b.bucket_id for b in self.buckets if b is not bucket]
        batch = SnapshotBatch("delete", partition_meta=self._store.root(ids))
        batch.delete_buckets.append(bucket.bucket_id)
        try:
            self._store.write(batch)
        except StorageError:
            return False
        self.buckets.remove(bucket)
        del self.by_id[bucket.bucket_id]
        self.rebuild_heap()
        return True

    # -- merges -----------------------------------------------------------------------------

    def merge(self, popped: int) -> bool:
        """Merge the best run of adjacent buckets now; False if storage failed."""
        if len(self.buckets) < 2:
            return True
        try:
            self._merge_run(*best_run(self.buckets), popped)
        except StorageError:
            return False
        return True

    def merge_over_limit(self, popped: int, force: bool = False) -> bool:
        """Merge until there are at most max_buckets; unless `force`, wait out a failure's retry interval."""
        store = self._store
        if not force and store.failing & {"merge", "load"} and self._clock.now_ms() < store.retry_at:
            return False
        while len(self.buckets) > self._max_buckets:
            try:
                self._merge_run(*best_run(self.buckets), popped)
            except StorageError:
                return False
        return True

    def _merge_run(self, index: int, width: int, popped: int) -> None:
        """Merge buckets index .. index + width - 1 into one, in one batch; raise StorageError on failure."""
        store = self._store
        if not store.ensure_cleared():
            raise StorageError("a clear is pending")
        started = time.perf_counter()
        sources = self.buckets[index : index + width]
        merged = merge_buckets(
            sources,
            store.next_bucket_id,
            durable=store.delivered_through,
            popped=popped,
            step=self._step,
            max_per_segment=self._max_per_segment,
            load=store.load_segments,
        )
        ids = self.ids()
        batch = SnapshotBatch("merge", delete_buckets=[b.bucket_id for b in sources])
        if merged is not None:
            bucket, write = merged
            ids[index : index + width] = [bucket.bucket_id]
            batch.buckets.append(write)
            batch.partition_meta = store.root(ids, next_bucket_id=bucket.bucket_id + 1)
        else:
            del ids[index : index + width]
            batch.partition_meta = store.root(ids)
        store.write(batch)
        for source in sources:
            del self.by_id[source.bucket_id]
        if merged is not None:
            bucket.activate(popped, store.load_segment, write.segments)
            self.buckets[index : index + width] = [bucket]
            self.by_id[bucket.bucket_id] = bucket
            store.next_bucket_id = bucket.bucket_id + 1
        else:
            del self.buckets[index : index + width]
        self.rebuild_heap()
        release_memory()
        into, entries, segments = (
            (bucket.bucket_id, bucket.stored, bucket.meta.segment_count) if merged else ("none", 0, 0)
        )
        self._logger.info(
            "buckets merged partition=%s buckets=%s into=%s entries=%d segments=%d ms=%.1f",
            store.partition,
            ",".join(str(b.bucket_id) for b in sources),
            into,
            entries,
            segments,
            (time.perf_counter() - started) * 1000,
        )
