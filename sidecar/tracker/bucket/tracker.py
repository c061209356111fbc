"""The bucket tracker: PIP-195's bucketed index for one inbound partition, durable in RocksDB.

Why it exists: the in-memory tracker costs memory for every delayed message and must replay the
whole backlog after a restart. Here the index is cut into immutable buckets whose segments live
on disk; memory holds the last mutable bucket, one loaded segment per bucket and compressed
offset bitmaps, whatever the backlog. A restart reads the bucket list and one segment per bucket.

This module composes the buckets (the package docstring lists the parts): it decides when the
mutable bucket is sealed and when buckets merge, pops across all of them in key order, and
writes the checkpoints that make adds and pops durable.

How it stays correct where Pulsar's did not:

* Pops are a prefix. Entries come out in key order (`deliver_at << 64 | offset`) and a new add
  is always later than now, hence later than anything popped. So one number, the key of the
  last popped entry (`delivered_through`), says which entries of every bucket and of the
  write-ahead log are delivered. A checkpoint makes it durable; popped entries above the durable
  value come back after a crash (at-least-once), and merges keep them on disk until then.
* A bucket's not-yet-loaded segments are never later than its loaded one's last entry, and the
  shared queue holds each bucket's head (or, if a segment load failed, the first key of the
  missing segment as a barrier). So pop_due never passes an entry that sits in an unloaded
  segment (Pulsar #26230), and next_delivery_time always names something to wake up for (#25996).
* A merge rewrites every entry later than the durable delivery point, window by window (#26251).
* The mutable bucket is durable too: its adds go to a write-ahead log at checkpoint, so a crash
  after a checkpoint loses nothing (Pulsar loses the last mutable bucket).
* Storage failures are retried, then the tracker degrades: indexes stay in memory, the failed
  operation is retried later, and `degraded` reports it. Nothing is dropped.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import time
from array import array

from pyroaring import BitMap64

from sidecar.clock import Clock
from sidecar.errors import ConfigError, StorageError
from sidecar.policy.by_key import KeyIndex
from sidecar.tracker.base import DelayedDeliveryTracker, Due, due_of
from sidecar.tracker.bucket.buckets import SealedBuckets
from sidecar.tracker.bucket.immutable import NO_KEY, ImmutableBucket
from sidecar.tracker.bucket.mutable import NO_AT, MutableBucket
from sidecar.tracker.bucket.stats import NullListener, TrackerListener, TrackerStats
from sidecar.tracker.bucket.store import PartitionStore, release_memory
from sidecar.tracker.keys import StoredKeys
from sidecar.tracker.storage.base import KEY_SHIFT, OFFSET_MASK, BucketWrite, SnapshotBatch, SnapshotStorage

logger = logging.getLogger(__name__)

_SHIFT = KEY_SHIFT
_MASK = OFFSET_MASK


class BucketTracker(DelayedDeliveryTracker):
    """Durable bucketed tracker of one inbound partition, over a storage shared by partitions.

    Construction recovers whatever `storage` holds for `partition` (a key such as
    "payments.orders/3"); `index_cursor()` then says where to resume consuming.
    """

    def __init__(
        self,
        clock: Clock,
        storage: SnapshotStorage,
        partition: str,
        *,
        min_index_count: int = 50_000,
        time_step_ms: int = 300_000,
        max_indexes_per_segment: int = 5_000,
        max_buckets: int = 50,
        retries: int = 2,
        retry_backoff_s: float = 0.05,
        retry_interval_ms: int = 5_000,
        bitmap_rewrite_ratio: float = 0.1,
        listener: TrackerListener | None = None,
        seal_behind: int | None = None,
    ) -> None:
        """`seal_behind`: also seal at a checkpoint once the mutable bucket's first offset is this many
        offsets behind the cursor, so that a new owner restoring from the state topic never reads
        more than about that much of the log again, however sparse the delayed records are."""
        super().__init__(clock)
        for name, value in (
            ("min_index_count", min_index_count),
            ("time_step_ms", time_step_ms),
            ("max_indexes_per_segment", max_indexes_per_segment),
            ("max_buckets", max_buckets),
        ):
            if value < 1:
                raise ConfigError(f"bucket tracker {name} must be at least 1, got {value}")
        if retries < 0 or retry_backoff_s < 0 or retry_interval_ms < 0 or not 0 <= bitmap_rewrite_ratio <= 1:
            raise ConfigError("bucket tracker retry settings must be >= 0 and bitmap_rewrite_ratio in [0, 1]")
        self._min_index_count = min_index_count
        self._seal_behind = seal_behind
        self._step = time_step_ms
        self._max_per_segment = max_indexes_per_segment
        self._rewrite_ratio = bitmap_rewrite_ratio
        self._storage, self._partition = storage, partition
        self._stored_keys: StoredKeys | None = None
        self._store = PartitionStore(
            storage,
            partition,
            clock,
            listener or NullListener(),
            logger,
            retries=retries,
            backoff_s=retry_backoff_s,
            retry_interval_ms=retry_interval_ms,
        )
        self._mutable = MutableBucket()
        self._sealed = SealedBuckets(
            self._store,
            clock,
            logger,
            step=time_step_ms,
            max_per_segment=max_indexes_per_segment,
            max_buckets=max_buckets,
        )
        self._reset_memory()
        self._recover()

    def _reset_memory(self) -> None:
        self._mutable.reset()
        self._sealed.reset()
        self._sealed_max_offset = -1
        """The highest offset any sealed bucket holds: above it, add need not look in them."""
        self._count = 0
        self._popped = self._store.delivered_through
        """The key of the last popped entry: every entry up to it has been popped (pops are a prefix)."""
        self._popped_at = self._popped >> _SHIFT

    def _recover(self) -> None:
        meta = self._store.recover_root()
        if meta is None:
            return
        self._popped = meta.delivered_through
        self._popped_at = self._popped >> _SHIFT
        self._sealed.recover(meta.bucket_ids, self._popped)
        self._sealed_max_offset = max((b.meta.max_offset for b in self._sealed.buckets), default=-1)
        self._mutable.recover(self._store.load_wal(), self._popped)
        self._count = self._mutable.count + sum(b.pending for b in self._sealed.buckets)
        logger.info(
            "tracker recovered partition=%s buckets=%d delayed=%d index_cursor=%s",
            self._store.partition,
            len(self._sealed.buckets),
            self._count,
            self._store.durable_cursor,
        )

    # -- the tracker contract ---------------------------------------------------------------

    def add(self, offset: int, deliver_at: int, *, deliver_now: bool = True) -> bool:
        mutable = self._mutable
        # An offset above every indexed one (the consumer moving on: nearly every add) cannot be
        # indexed yet, so only a replayed or re-added offset pays for the bitmap lookups.
        if offset <= mutable.max_offset or offset <= self._sealed_max_offset:
            if offset > self._sealed_max_offset:
                if offset in mutable.bitmap:
                    return True
            elif self.contains(offset):
                return True
        if deliver_at <= self._popped_at and deliver_at << _SHIFT | offset <= self._popped:
            # At or below the delivered watermark (a rebuild, or the clock stepped back): due by an
            # earlier pop, and keeping it would break the popped-prefix invariant durability rests on.
            return False
        now = self.clock.now_ms()
        if deliver_at <= now and deliver_now:
            head = self.next_delivery_time()
            if head is None or deliver_at < head:
                # Due, and nothing indexed comes first: delivered now, as if popped.
                self._popped, self._popped_at = deliver_at << _SHIFT | offset, deliver_at
                return False
            # Due behind indexed entries: it comes out after them, keeping pops in key order.
        if offset > mutable.max_offset:
            if mutable.count >= self._min_index_count:
                self._seal_and_merge(now)  # a seal empties `mutable` in place
            mutable.max_offset = offset
        mutable.unsorted_at.append(deliver_at)
        mutable.unsorted_offsets.append(offset)
        if deliver_at < mutable.unsorted_min_at:  # noqa: PLR1730 - the hot path; min() costs a call
            mutable.unsorted_min_at = deliver_at
        mutable.bitmap.add(offset)
        mutable.count += 1
        self._count += 1
        return True

    def add_many(self, offsets: list[int], deliver_ats: list[int], *, deliver_now: bool = True) -> list[int]:
        """A slice of intake in one step when it is the common case: every offset above every indexed
        one, none at the watermark (nor due, unless `deliver_now` is off), and no seal on the way.
        Else one `add` at a time."""
        mutable, n = self._mutable, len(offsets)
        if n and offsets[0] > mutable.max_offset and offsets[0] > self._sealed_max_offset:
            low = min(deliver_ats)
            due = deliver_now and low <= self.clock.now_ms()
            if mutable.count + n <= self._min_index_count and low > self._popped_at and not due:
                mutable.unsorted_at.extend(deliver_ats)
                mutable.unsorted_offsets.extend(offsets)
                mutable.unsorted_min_at = min(mutable.unsorted_min_at, low)
                last = offsets[-1]
                if last - offsets[0] == n - 1:  # consecutive offsets: the usual slice of delayed records
                    mutable.bitmap.add_range(offsets[0], last + 1)
                else:
                    mutable.bitmap.update(offsets)
                mutable.max_offset = last
                mutable.count += n
                self._count += n
                return []
        return super().add_many(offsets, deliver_ats, deliver_now=deliver_now)

    def next_delivery_time(self) -> int | None:
        heap, mutable = self._sealed.heap, self._mutable
        head = heap[0][0] if heap else NO_KEY
        if mutable.sorted_keys:
            head = min(head, mutable.sorted_keys[0])
        at = min(head >> _SHIFT, mutable.unsorted_min_at)
        return None if at == NO_AT else at

    def pop_due(self, max_messages: int, until_ms: int | None = None) -> list[Due]:
        """Pops in key order, a run at a time: the entries of one source (a loaded segment, or the
        mutable bucket's sorted keys) that come before every other source's head are taken as one
        slice. A burst due at once pops in runs of thousands, where an entry at a time cost a heap
        operation and a bitmap call each. Delays spread over time interleave the buckets, so most
        runs are one entry: that case takes no slices, and each bitmap is updated once per call."""
        now = self.clock.now_ms() if until_ms is None else until_ms
        limit = (now + 1) << _SHIFT
        mutable, sealed, store = self._mutable, self._sealed, self._store
        if mutable.unsorted_min_at <= now:
            mutable.merge_unsorted()
        heap, queue, by_id = sealed.heap, mutable.sorted_keys, sealed.by_id
        due: list[Due] = []
        gone: dict[ImmutableBucket, list[int]] = {}
        """Offsets popped per sealed bucket, out of its pending bitmap at the end (activate does not read it)."""
        popped_keys: list[int] = []
        mutable_head = queue[0] if queue else NO_KEY  # a SortedList lookup: read again only after its pops
        try:
            while len(due) < max_messages:
                if heap and heap[0][0] < mutable_head:
                    key, bucket_id = heap[0]
                    if key >= limit:
                        break
                    bucket = by_id[bucket_id]
                    if bucket.blocked:
                        if now < store.retry_at and "load" in store.failing:
                            break
                        try:
                            head = bucket.activate(self._popped, store.load_segment)
                        except StorageError:
                            break
                        sealed.replace_head(bucket, head)
                        continue
                    # The run: this segment's entries below the limit, the mutable head and the next bucket's head.
                    bound = min(limit, mutable_head, min(heap[1:3])[0] if len(heap) > 1 else NO_KEY)
                    at, offsets, pos = bucket.at, bucket.offsets, bucket.pos
                    stop = min(len(offsets), pos + max_messages - len(due))
                    end = pos + 1
                    taken_offsets = gone.get(bucket)
                    if taken_offsets is None:
                        taken_offsets = gone[bucket] = []
                    if end < stop and (at[end] << _SHIFT | offsets[end]) < bound:
                        end = _run_end(at, offsets, pos, stop, bound)
                        run_offsets = offsets[pos:end]
                        due += map(due_of, zip(at[pos:end], run_offsets, strict=True))
                        taken_offsets += run_offsets
                    else:  # a run of one entry
                        offset = offsets[pos]
                        due.append(due_of((at[pos], offset)))
                        taken_offsets.append(offset)
                    taken = end - pos
                    bucket.pending -= taken
                    bucket.popped_since_bitmap += taken
                    bucket.pos = end
                    self._popped = at[end - 1] << _SHIFT | offsets[end - 1]
                    if end < len(offsets):
                        heapq.heapreplace(heap, (at[end] << _SHIFT | offsets[end], bucket_id))
                    else:
                        bucket.segment += 1
                        try:
                            head = bucket.activate(self._popped, store.load_segment)
                        except StorageError:
                            head = bucket.head()
                        sealed.replace_head(bucket, head)
                else:
                    if mutable_head >= limit:
                        break
                    # The run: keys below the limit, and up to the next bucket's head (the mutable bucket wins ties).
                    if not heap or (len(queue) > 1 and queue[1] < heap[0][0] and queue[1] < limit):
                        end = queue.bisect_left(limit)
                        if heap:
                            end = min(end, queue.bisect_right(heap[0][0]))
                        end = min(end, max_messages - len(due))
                        keys = queue[:end]
                        del queue[:end]
                    else:  # a run of one key
                        keys = [queue.pop(0)]
                    mutable_head = queue[0] if queue else NO_KEY
                    mutable.count -= len(keys)
                    due += map(due_of, zip([k >> _SHIFT for k in keys], [k & _MASK for k in keys], strict=True))
                    popped_keys += keys
                    self._popped = keys[-1]
        finally:
            for bucket, offsets_gone in gone.items():
                bucket.bitmap.difference_update(BitMap64(offsets_gone))
            if popped_keys:
                mutable.bitmap.difference_update(BitMap64([k & _MASK for k in popped_keys]))
                mutable.popped += popped_keys
        self._count -= len(due)
        self._popped_at = self._popped >> _SHIFT
        return due

    def peek(self, after: Due | None, until_ms: int, max_messages: int) -> list[Due]:
        """Entries due by until_ms and after `after`, without popping them.

        Looks at what is in memory: the mutable bucket and each bucket's loaded segment. Entries
        of segments not loaded yet are left out, as the contract allows (they are read when
        popped). Nothing changes but the order of the mutable bucket's recent adds.
        """
        low = after.deliver_at << _SHIFT | after.offset if after is not None else -1
        limit = (until_ms + 1) << _SHIFT
        mutable = self._mutable
        if mutable.unsorted_min_at <= until_ms:
            mutable.merge_unsorted()
        found: list[int] = list(mutable.sorted_keys.irange(low, limit, inclusive=(False, False)))
        self._sealed.peek_loaded(low, limit, found)
        found.sort()
        return [Due(key >> _SHIFT, key & _MASK) for key in found[:max_messages]]

    def due_counts(self, limits: list[int]) -> list[int]:
        """Exact for the mutable bucket and each sealed bucket's loaded segment; a segment not loaded
        counts in full when its last deliver-at is within a limit, and in proportion to its span of
        deliver-at when a limit falls inside it. One pass over the segment tables."""
        mutable = self._mutable
        counts = [mutable.sorted_keys.bisect_left((limit + 1) << _SHIFT) for limit in limits]
        for at in mutable.unsorted_at:
            for i, limit in enumerate(limits):
                if at <= limit:
                    counts[i] += 1
        for bucket in self._sealed.buckets:
            meta, loaded = bucket.meta, len(bucket.at) > 0
            if loaded:
                for i, limit in enumerate(limits):
                    counts[i] += bisect.bisect_right(bucket.at, limit, lo=bucket.pos) - bucket.pos
            for segment in range(bucket.segment + 1 if loaded else bucket.segment, meta.segment_count):
                low, high, size = meta.seg_min_at[segment], meta.seg_max_at[segment], meta.seg_count[segment]
                for i, limit in enumerate(limits):
                    if high <= limit:
                        counts[i] += size
                    elif low <= limit:
                        counts[i] += size * (limit - low) // max(high - low, 1)
        return [min(n, self._count) for n in counts]

    def contains(self, offset: int) -> bool:
        if offset in self._mutable.bitmap:
            return True
        if offset > self._sealed_max_offset:
            return False
        for bucket in self._sealed.buckets:
            meta = bucket.meta
            if meta.min_offset <= offset <= meta.max_offset and offset in bucket.bitmap:
                return True
        return False

    def __len__(self) -> int:
        return self._count

    def earliest_pending_offset(self) -> int | None:
        candidates = [b.bitmap.min() for b in self._sealed.buckets if b.pending]
        if self._mutable.bitmap:
            candidates.append(self._mutable.bitmap.min())
        return min(candidates) if candidates else None

    @property
    def durable(self) -> bool:
        return True

    def index_cursor(self) -> int | None:
        """The cursor of the last successful checkpoint: resume consuming (and commit) there."""
        return self._store.durable_cursor

    def lineage(self) -> tuple[str, ...]:
        return self._store.lineage

    def checkpointed_rules(self) -> str:
        return self._store.rules

    def delivered_through(self) -> int:
        return self._popped

    def restore_delivered_through(self, key: int) -> None:
        self._store.delivered_through = self._popped = max(key, 0)
        self._popped_at = self._popped >> _SHIFT

    @property
    def degraded(self) -> bool:
        """True while a storage operation failed and waits for a retry; indexes are in memory."""
        return bool(self._store.failing) or self._store.clear_pending

    def ranges_due(self, after_ms: int, until_ms: int) -> list[tuple[int, int]]:
        """A sealed bucket's whole offset range when one of its pending segments overlaps the window
        (a bucket is one stretch of the log: PIP-195), and the mutable bucket's when it holds such an entry."""
        out = []
        for bucket in self._sealed.buckets:
            meta = bucket.meta
            if bucket.pending and any(
                meta.seg_min_at[s] <= until_ms and meta.seg_max_at[s] > after_ms
                for s in range(bucket.segment, meta.segment_count)
            ):
                out.append((meta.min_offset, meta.max_offset))
        mutable = self._mutable
        if mutable.count and (
            any(after_ms < at <= until_ms for at in mutable.unsorted_at)
            or any(True for _ in mutable.sorted_keys.irange((after_ms + 1) << _SHIFT, (until_ms + 1) << _SHIFT))
        ):
            out.append((mutable.bitmap.min(), mutable.bitmap.max()))
        return out

    def snapshots(self) -> BucketTracker:
        return self

    def sealed_layout(self) -> tuple[tuple[int, ...], int, int | None]:
        """(live bucket ids, next bucket id, lowest offset of the mutable bucket): what a state-topic
        manifest says of this index."""
        mutable = self._mutable
        lowest = mutable.bitmap.min() if mutable.bitmap else None
        return tuple(self._sealed.ids()), self._store.next_bucket_id, lowest

    def restore(self, buckets: list[BucketWrite], next_bucket_id: int, delivered_through: int) -> None:
        """Replace this partition's index by sealed buckets taken from the state topic.

        Everything up to `delivered_through` (the commit's watermark) counts as delivered. The
        index has no cursor until the caller has read the log again from the manifest's tail.
        Raises StorageError when the local store cannot take it.
        """
        store = self._store
        store.durable_cursor, store.wal_seq, store.lineage, store.rules = None, 0, (), ""
        store.delivered_through = max(delivered_through, 0)
        store.next_bucket_id = next_bucket_id
        root = store.root([b.meta.bucket_id for b in buckets])
        store.clear_pending = False
        store.write(SnapshotBatch("restore", partition_meta=root, buckets=buckets, clear_partition=True))
        self._reset_memory()
        self._recover()

    def checkpoint(self, index_cursor: int, lineage: tuple[str, ...] = (), rules: str = "") -> None:
        """Make adds and pops durable and record index_cursor and lineage, in one atomic batch.

        On a storage failure the tracker degrades instead of raising: `index_cursor()` keeps
        the last durable cursor, which is what the caller must commit, and the next checkpoint
        retries with everything accumulated since.
        """
        store = self._store
        if not store.ensure_cleared():
            return
        self._retry_deferred()
        behind = self._seal_behind
        if behind is not None and self._mutable.bitmap and index_cursor - self._mutable.bitmap.min() >= behind:
            self._seal_and_merge(self.clock.now_ms())
        popped = self._popped
        batch = SnapshotBatch(
            "checkpoint",
            partition_meta=store.root(
                self._sealed.ids(), index_cursor=index_cursor, delivered_through=popped, lineage=lineage, rules=rules
            ),
        )
        chunk, replaces_log, wal_stored = self._mutable.wal_chunk()
        if chunk is not None:
            batch.wal_reset = replaces_log
            batch.wal_append = (store.wal_seq, chunk)
            assert batch.partition_meta is not None
            batch.partition_meta.wal_seq = store.wal_seq + 1
        rewrites = [
            (b, b.bitmap_write(popped)) for b in self._sealed.buckets if b.needs_bitmap_rewrite(self._rewrite_ratio)
        ]
        for bucket, write in rewrites:
            batch.buckets.append(write)
            batch.delete_segments.append((bucket.bucket_id, bucket.meta.first_segment, bucket.segment))
        try:
            store.write(batch)
        except StorageError:
            return
        store.durable_cursor, store.delivered_through, store.lineage = index_cursor, popped, lineage
        store.rules = rules
        if chunk is not None:
            store.wal_seq += 1
        self._mutable.checkpointed(chunk is not None, wal_stored)
        for bucket, write in rewrites:
            bucket.bitmap_written(write)
        self._sealed.delete_delivered()

    def _retry_deferred(self) -> None:
        """Retry a seal or merge that failed earlier (or is due after a config change)."""
        sealing = self._mutable.count >= self._min_index_count and "create" in self._store.failing
        if sealing and not self._seal():
            return
        self._sealed.merge_over_limit(self._popped, force=True)

    def key_index(self) -> KeyIndex:
        """In the state dir's RocksDB, under the partition's prefix (tracker/keys.py)."""
        if self._stored_keys is None:
            self._stored_keys = StoredKeys(self._storage, self._partition)
        return self._stored_keys

    def clear(self) -> None:
        super().clear()
        self._stored_keys = None
        self._store.delivered_through = 0
        self._reset_memory()
        self._store.clear()

    def close(self) -> None:
        self._reset_memory()

    # -- sealing and merging ----------------------------------------------------------------

    def _seal_and_merge(self, now: int) -> None:
        if self._store.failing & {"create", "merge", "clear"} and now < self._store.retry_at:
            return
        if self._seal():
            self._sealed.merge_over_limit(self._popped)

    def seal(self) -> bool:
        """Seal the mutable bucket now (normally done by add); False if storage failed."""
        if not self._mutable.count:
            return True
        return self._seal() and self._sealed.merge_over_limit(self._popped, force=True)

    def _seal(self) -> bool:
        """Turn the mutable bucket into a sealed one, in one batch that also resets the log."""
        mutable, store = self._mutable, self._store
        if not mutable.count and not mutable.popped:
            return True
        if not store.ensure_cleared():
            return False
        started = time.perf_counter()
        bucket_id = store.next_bucket_id
        sealed = mutable.seal(bucket_id, self._step, self._max_per_segment)
        if sealed is None:
            return True
        bucket, write = sealed
        batch = SnapshotBatch(
            "create",
            partition_meta=store.root([*self._sealed.ids(), bucket_id], next_bucket_id=bucket_id + 1),
            buckets=[write],
            wal_reset=True,
        )
        try:
            store.write(batch)
        except StorageError:
            return False
        self._sealed.add(bucket, write.segments, self._popped)
        store.next_bucket_id = bucket_id + 1
        self._sealed_max_offset = max(self._sealed_max_offset, bucket.meta.max_offset)
        mutable.reset()
        release_memory()
        logger.info(
            "bucket sealed partition=%s bucket=%d entries=%d segments=%d ms=%.1f",
            store.partition,
            bucket_id,
            bucket.stored,
            bucket.meta.segment_count,
            (time.perf_counter() - started) * 1000,
        )
        return True

    def merge(self) -> bool:
        """Merge the best run of adjacent buckets now (normally done past max_buckets)."""
        return self._sealed.merge(self._popped)

    # -- metrics ----------------------------------------------------------------------------

    def stats(self) -> TrackerStats:
        buckets, store = self._sealed.buckets, self._store
        failing = set(store.failing) | ({"clear"} if store.clear_pending else set())
        return TrackerStats(
            delayed=self._count,
            buckets=len(buckets),
            mutable_indexes=self._mutable.count,
            loaded_indexes=self._mutable.count + sum(len(b.offsets) - b.pos for b in buckets),
            snapshot_bytes=sum(b.snapshot_bytes for b in buckets),
            degraded=bool(failing),
            degraded_ops=tuple(sorted(failing)),
            ops=dict(store.ops),
        )


def _run_end(at: array[int], offsets: array[int], pos: int, end: int, bound: int) -> int:
    """The end of the run of a loaded segment from `pos`, whose entry is taken whatever `bound` (the
    heap chose it, ties included): the first index after it and before `end` whose key is at or past
    `bound`, found by bisecting the deliver-at column."""
    bound_at, bound_offset = bound >> _SHIFT, bound & _MASK
    stop = bisect.bisect_left(at, bound_at, pos + 1, end)
    while stop < end and at[stop] == bound_at and offsets[stop] < bound_offset:
        stop += 1
    return stop
