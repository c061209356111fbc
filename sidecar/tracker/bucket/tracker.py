"""The bucket tracker: PIP-195's bucketed index for one inbound partition, durable in RocksDB.

Why it exists: the in-memory tracker costs memory for every delayed message and must replay the
whole backlog after a restart. Here the index is cut into immutable buckets whose segments live
on disk; memory holds the last mutable bucket, one loaded segment per bucket and compressed
offset bitmaps, whatever the backlog. A restart reads the bucket list and one segment per bucket.

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

Segments are cut on epoch-aligned windows of `time_step_ms`, so segments of different buckets
covering the same window can be merged window by window, with bounded memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import heapq
import logging
import time
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from pyroaring import BitMap64
from sortedcontainers import SortedList

from sidecar.clock import Clock
from sidecar.errors import ConfigError, StorageError
from sidecar.tracker.base import DelayedDeliveryTracker, Due
from sidecar.tracker.bucket.stats import NullListener, TrackerListener, TrackerStats
from sidecar.tracker.storage.base import (
    KEY_SHIFT,
    OFFSET_MASK,
    BucketMeta,
    BucketWrite,
    OpKind,
    PartitionMeta,
    Segment,
    SnapshotBatch,
    SnapshotStorage,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SHIFT = KEY_SHIFT
_MASK = OFFSET_MASK
_NO_KEY = 1 << 256
"""Later than any packed key: the head of an empty source."""
_NO_AT = _NO_KEY >> _SHIFT
"""Later than any deliver-at: the earliest deliver-at of an empty buffer."""
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
_ENTRY_BYTES = 16
_WAL_COMPACT_MIN = 4096
"""Below this many logged entries the write-ahead log is never rewritten."""


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def _release_memory() -> None:
    """Give the heap freed by a seal or merge back to the OS (glibc keeps it otherwise).

    A seal or merge builds its segments, their encoding and RocksDB's write batch at once, then
    drops them; without this the process keeps that peak, and resident memory would grow with
    the largest merge rather than stay bounded by what the tracker holds.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _cut(keys: list[int], step: int, max_per_segment: int) -> list[Segment]:
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


def _bucket_meta(bucket_id: int, segments: list[Segment], min_offset: int, max_offset: int) -> BucketMeta:
    return BucketMeta(
        bucket_id=bucket_id,
        first_segment=0,
        bitmap_through=0,
        min_offset=min_offset,
        max_offset=max_offset,
        seg_min_at=array("q", [s.deliver_at[0] for s in segments]),
        seg_max_at=array("q", [s.deliver_at[-1] for s in segments]),
        seg_count=array("q", [len(s) for s in segments]),
    )


def _keys(segment: Segment) -> list[int]:
    return [d << _SHIFT | o for d, o in zip(segment.deliver_at, segment.offsets, strict=True)]


def _latest_per_offset(keys: list[int], pending: BitMap64) -> list[int]:
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


class _Bucket:
    """A sealed bucket in memory: its segment table, pending bitmap and one loaded segment."""

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

    def min_key(self, segment: int) -> int:
        return self.meta.min_key(segment)

    def max_key(self, segment: int) -> int:
        return self.meta.max_key(segment)

    def head(self) -> int:
        if self.blocked:
            # A barrier no later than anything in the missing segment.
            return self.min_key(self.segment)
        if self.pos < len(self.offsets):
            return self.at[self.pos] << _SHIFT | self.offsets[self.pos]
        return _NO_KEY

    @property
    def snapshot_bytes(self) -> int:
        return self.stored * _ENTRY_BYTES + self.bitmap_bytes


class _SegmentReader:
    """Reads a source bucket's segments for a merge, in number order, a chunk per storage call."""

    __slots__ = ("_buffer", "_end", "_load")

    def __init__(self, load: Callable[[int, int], list[Segment]], end: int) -> None:
        self._load = load
        self._end = end
        self._buffer: dict[int, Segment] = {}

    def get(self, number: int, keep: bool = False) -> Segment:
        """Segment `number`; dropped from the buffer unless `keep` (it is read again later)."""
        segment = self._buffer.get(number) if keep else self._buffer.pop(number, None)
        if segment is None:
            stop = min(number + _READ_CHUNK, self._end)
            self._buffer = dict(zip(range(number, stop), self._load(number, stop), strict=True))
            segment = self._buffer[number] if keep else self._buffer.pop(number)
        return segment


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
    ) -> None:
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
        self._storage = storage
        self._partition = partition
        self._min_index_count = min_index_count
        self._step = time_step_ms
        self._max_per_segment = max_indexes_per_segment
        self._max_buckets = max_buckets
        self._retries = retries
        self._retry_backoff_s = retry_backoff_s
        self._retry_interval_ms = retry_interval_ms
        self._rewrite_ratio = bitmap_rewrite_ratio
        self._listener: TrackerListener = listener or NullListener()
        self._ops: Counter[tuple[str, str]] = Counter()
        self._failing: set[str] = set()
        self._retry_at = 0
        self._clear_pending = False
        self._next_bucket_id = 1
        self._wal_seq = 0
        self._durable_cursor: int | None = None
        self._durable_popped = 0
        self._reset_memory()
        self._recover()

    # -- state ------------------------------------------------------------------------------

    def _reset_memory(self) -> None:
        self._mutable: SortedList = SortedList()
        self._unsorted_at: array[int] = array("q")
        self._unsorted_offsets: array[int] = array("Q")
        """Recent adds not yet in the sorted list, as two columns: an append is several times
        cheaper than an insort, and nothing in here is needed in order until its earliest
        deliver-at falls due or a seal. Columns hold an entry in 16 bytes where a packed int in a
        list takes 48; a seal builds the keys all at once, faster than one per add."""
        self._unsorted_min_at = _NO_AT
        self._mutable_count = 0
        """Entries in the sorted list and the unsorted columns (SortedList's len is a Python call)."""
        self._mutable_bitmap = BitMap64()
        self._mutable_max_offset = -1
        self._mutable_popped: list[int] = []
        self._wal_at: array[int] = array("q")
        self._wal_offsets: array[int] = array("Q")
        """Adds not yet logged that have moved from the unsorted columns to the sorted list."""
        self._wal_mark = 0
        """Unsorted entries from this index on are not logged yet: the log of the mutable bucket
        is these plus `_wal_at`/`_wal_offsets`, so an add is written to memory once."""
        self._wal_stored = 0
        self._buckets: list[_Bucket] = []
        self._by_id: dict[int, _Bucket] = {}
        self._heap: list[tuple[int, int]] = []
        self._sealed_max_offset = -1
        self._count = 0
        self._popped = self._durable_popped
        self._popped_at = self._popped >> _SHIFT

    def _mutable_size(self) -> int:
        return self._mutable_count

    def _sorted_mutable(self) -> SortedList:
        at, offsets, mark = self._unsorted_at, self._unsorted_offsets, self._wal_mark
        if offsets:
            if mark < len(offsets):
                self._wal_at.extend(at[mark:])
                self._wal_offsets.extend(offsets[mark:])
            self._mutable.update([d << _SHIFT | o for d, o in zip(at, offsets, strict=True)])
            self._clear_unsorted()
        return self._mutable

    def _clear_unsorted(self) -> None:
        self._unsorted_at, self._unsorted_offsets = array("q"), array("Q")
        self._unsorted_min_at, self._wal_mark = _NO_AT, 0

    def _rebuild_heap(self) -> None:
        self._heap = [(head, b.bucket_id) for b in self._buckets if (head := b.head()) != _NO_KEY]
        heapq.heapify(self._heap)

    def _partition_meta(self, **changes: object) -> PartitionMeta:
        """The root record as it is durable now, with the changes the batch being built makes."""
        meta = PartitionMeta(
            partition=self._partition,
            index_cursor=self._durable_cursor,
            delivered_through=self._durable_popped,
            bucket_ids=[b.bucket_id for b in self._buckets],
            next_bucket_id=self._next_bucket_id,
            wal_seq=self._wal_seq,
        )
        return dataclasses.replace(meta, **changes)  # type: ignore[arg-type]

    # -- storage calls ----------------------------------------------------------------------

    def _with_retries(self, kind: OpKind, action: Callable[[], T]) -> T:
        """Run a storage call, retrying; on final failure mark `kind` degraded and re-raise."""
        delay = self._retry_backoff_s
        for attempt in range(self._retries + 1):
            started = time.perf_counter()
            try:
                result = action()
            except StorageError as exc:
                self._record(kind, False, time.perf_counter() - started)
                if attempt == self._retries:
                    self._failing.add(kind)
                    self._retry_at = self.clock.now_ms() + self._retry_interval_ms
                    logger.warning(
                        "tracker storage op failed, degraded partition=%s op=%s attempts=%d error=%s",
                        self._partition,
                        kind,
                        attempt + 1,
                        exc,
                    )
                    raise
                if delay:
                    time.sleep(delay)
                    delay *= 2
                continue
            self._record(kind, True, time.perf_counter() - started)
            self._failing.discard(kind)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _record(self, kind: str, ok: bool, seconds: float) -> None:
        self._ops[(kind, "succeed" if ok else "failed")] += 1
        self._listener.on_op(kind, ok, seconds)

    def _write(self, batch: SnapshotBatch) -> int:
        return self._with_retries(batch.kind, lambda: self._storage.write(self._partition, batch))

    def _load_segment(self, bucket: _Bucket, segment: int) -> Segment:
        return self._with_retries(
            "load", lambda: self._storage.load_segment(self._partition, bucket.bucket_id, segment)
        )

    def _activate(self, bucket: _Bucket, preloaded: dict[int, Segment] | None = None) -> int:
        """Load the bucket's current segment, skipping delivered entries; return its head key.

        Moves on to the next segment when one holds nothing pending. On a failed load the
        bucket is blocked: its head becomes the first key of the missing segment, so nothing
        later is popped before the segment is loaded. Raises StorageError in that case.
        """
        meta, popped = bucket.meta, self._popped
        while bucket.segment < meta.segment_count:
            number = bucket.segment
            if bucket.max_key(number) <= popped:
                bucket.segment += 1
                continue
            segment = preloaded.get(number) if preloaded is not None else None
            if segment is None:
                try:
                    segment = self._load_segment(bucket, number)
                except StorageError:
                    bucket.blocked = True
                    bucket.at, bucket.offsets, bucket.pos = array("q"), array("Q"), 0
                    raise
            at, offsets, pos, n = segment.deliver_at, segment.offsets, 0, len(segment)
            while pos < n and (at[pos] << _SHIFT | offsets[pos]) <= popped:
                pos += 1
            bucket.blocked = False
            bucket.at, bucket.offsets, bucket.pos = at, offsets, pos
            if pos < n:
                return at[pos] << _SHIFT | offsets[pos]
            bucket.segment += 1
        bucket.blocked = False
        bucket.at, bucket.offsets, bucket.pos = array("q"), array("Q"), 0
        return _NO_KEY

    def _ensure_cleared(self) -> bool:
        """Finish a clear() whose storage delete failed before writing anything else."""
        if not self._clear_pending:
            return True
        try:
            self._write(SnapshotBatch("clear", clear_partition=True))
        except StorageError:
            return False
        self._clear_pending = False
        return True

    # -- recovery ---------------------------------------------------------------------------

    def _recover(self) -> None:
        meta = self._storage.load_partition(self._partition)
        if meta is None:
            return
        self._durable_cursor = meta.index_cursor
        self._durable_popped = self._popped = meta.delivered_through
        self._popped_at = self._popped >> _SHIFT
        self._next_bucket_id = meta.next_bucket_id
        self._wal_seq = meta.wal_seq
        through = self._popped
        for bucket_id in meta.bucket_ids:
            bucket_meta, raw_bitmap = self._storage.load_bucket(self._partition, bucket_id)
            try:
                bitmap = BitMap64.deserialize(raw_bitmap)
            except Exception as exc:
                raise StorageError(
                    f"the bitmap of bucket {bucket_id} of partition {self._partition!r} in "
                    f"{self._storage.location} is unreadable ({exc}). Move the state dir aside and "
                    "restart to rebuild from the committed Kafka offsets."
                ) from exc
            bucket = _Bucket(bucket_meta, bitmap, 0, len(raw_bitmap))
            # The stored bitmap still holds what was popped after bitmap_through: drop it.
            loaded: dict[int, Segment] = {}
            for number in range(bucket_meta.first_segment, bucket_meta.segment_count):
                if bucket.min_key(number) > through:
                    break
                if bucket.max_key(number) <= bucket_meta.bitmap_through:
                    continue
                segment = self._load_segment(bucket, number)
                loaded[number] = segment
                for d, o in zip(segment.deliver_at, segment.offsets, strict=True):
                    if d << _SHIFT | o <= through:
                        bitmap.discard(o)
            bitmap.run_optimize()
            bucket.pending = len(bitmap)
            self._activate(bucket, loaded)
            self._buckets.append(bucket)
            self._by_id[bucket_id] = bucket
            self._sealed_max_offset = max(self._sealed_max_offset, bucket_meta.max_offset)
        latest: dict[int, int] = {}
        for chunk in self._storage.load_wal(self._partition):
            self._wal_stored += len(chunk)
            for d, o in zip(chunk.deliver_at, chunk.offsets, strict=True):
                latest[o] = d
        keys = [d << _SHIFT | o for o, d in latest.items() if d << _SHIFT | o > through]
        self._mutable = SortedList(keys)
        self._mutable_count = len(keys)
        self._mutable_bitmap = BitMap64(array("Q", [k & _MASK for k in keys]))
        self._mutable_max_offset = self._mutable_bitmap.max() if keys else -1
        self._count = len(keys) + sum(b.pending for b in self._buckets)
        self._rebuild_heap()
        logger.info(
            "tracker recovered partition=%s buckets=%d delayed=%d index_cursor=%s",
            self._partition,
            len(self._buckets),
            self._count,
            self._durable_cursor,
        )

    # -- the tracker contract ---------------------------------------------------------------

    def add(self, offset: int, deliver_at: int) -> bool:
        # An offset above every indexed one (the consumer moving on: nearly every add) cannot be
        # indexed yet, so only a replayed or re-added offset pays for the bitmap lookups.
        if offset <= self._mutable_max_offset or offset <= self._sealed_max_offset:
            if offset > self._sealed_max_offset:
                if offset in self._mutable_bitmap:
                    return True
            elif self.contains(offset):
                return True
        if deliver_at <= self._popped_at and deliver_at << _SHIFT | offset <= self._popped:
            # At or below the delivered watermark (a rebuild, or the clock stepped back): due by an
            # earlier pop, and keeping it would break the popped-prefix invariant durability rests on.
            return False
        now = self.clock.now_ms()
        if deliver_at <= now:
            head = self.next_delivery_time()
            if head is None or deliver_at < head:
                # Due, and nothing indexed comes first: delivered now, as if popped.
                self._popped, self._popped_at = deliver_at << _SHIFT | offset, deliver_at
                return False
            # Due behind indexed entries: it comes out after them, keeping pops in key order.
        if offset > self._mutable_max_offset:
            if self._mutable_count >= self._min_index_count:
                self._seal_and_merge(now)
            self._mutable_max_offset = offset
        self._unsorted_at.append(deliver_at)
        self._unsorted_offsets.append(offset)
        if deliver_at < self._unsorted_min_at:  # noqa: PLR1730 - the hot path; min() costs a call
            self._unsorted_min_at = deliver_at
        self._mutable_bitmap.add(offset)
        self._mutable_count += 1
        self._count += 1
        return True

    def next_delivery_time(self) -> int | None:
        head = self._heap[0][0] if self._heap else _NO_KEY
        if self._mutable:
            head = min(head, self._mutable[0])
        at = min(head >> _SHIFT, self._unsorted_min_at)
        return None if at == _NO_AT else at

    def pop_due(self, max_messages: int, until_ms: int | None = None) -> list[Due]:
        now = self.clock.now_ms() if until_ms is None else until_ms
        limit = (now + 1) << _SHIFT
        if self._unsorted_min_at <= now:
            self._sorted_mutable()
        heap, mutable, by_id = self._heap, self._mutable, self._by_id
        due: list[Due] = []
        while len(due) < max_messages:
            mutable_head = mutable[0] if mutable else _NO_KEY
            if heap and heap[0][0] < mutable_head:
                key, bucket_id = heap[0]
                if key >= limit:
                    break
                bucket = by_id[bucket_id]
                if bucket.blocked:
                    if now < self._retry_at and "load" in self._failing:
                        break
                    try:
                        head = self._activate(bucket)
                    except StorageError:
                        break
                    self._replace_head(bucket, head)
                    continue
                pos = bucket.pos
                offset = bucket.offsets[pos]
                bucket.bitmap.discard(offset)
                bucket.pending -= 1
                bucket.popped_since_bitmap += 1
                pos += 1
                bucket.pos = pos
                self._popped = key
                if pos < len(bucket.offsets):
                    heapq.heapreplace(heap, (bucket.at[pos] << _SHIFT | bucket.offsets[pos], bucket_id))
                else:
                    bucket.segment += 1
                    try:
                        head = self._activate(bucket)
                    except StorageError:
                        head = bucket.head()
                    self._replace_head(bucket, head)
            else:
                key = mutable_head
                if key >= limit:
                    break
                mutable.pop(0)
                self._mutable_count -= 1
                offset = key & _MASK
                self._mutable_bitmap.discard(offset)
                self._mutable_popped.append(key)
                self._popped = key
            due.append(Due(key >> _SHIFT, offset))
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
        if self._unsorted_min_at <= until_ms:
            self._sorted_mutable()
        found: list[int] = list(self._mutable.irange(low, limit, inclusive=(False, False)))
        for bucket in self._buckets:
            at, offsets = bucket.at, bucket.offsets
            for pos in range(bucket.pos, len(offsets)):
                key = at[pos] << _SHIFT | offsets[pos]
                if key >= limit:
                    break
                if key > low:
                    found.append(key)
        found.sort()
        return [Due(key >> _SHIFT, key & _MASK) for key in found[:max_messages]]

    def _replace_head(self, bucket: _Bucket, head: int) -> None:
        """Replace the heap top, which belongs to `bucket`, by its new head (or drop it)."""
        if head == _NO_KEY:
            heapq.heappop(self._heap)
        else:
            heapq.heapreplace(self._heap, (head, bucket.bucket_id))

    def contains(self, offset: int) -> bool:
        if offset in self._mutable_bitmap:
            return True
        if offset > self._sealed_max_offset:
            return False
        for bucket in self._buckets:
            meta = bucket.meta
            if meta.min_offset <= offset <= meta.max_offset and offset in bucket.bitmap:
                return True
        return False

    def __len__(self) -> int:
        return self._count

    def earliest_pending_offset(self) -> int | None:
        candidates = [b.bitmap.min() for b in self._buckets if b.pending]
        if self._mutable_bitmap:
            candidates.append(self._mutable_bitmap.min())
        return min(candidates) if candidates else None

    @property
    def durable(self) -> bool:
        return True

    def index_cursor(self) -> int | None:
        """The cursor of the last successful checkpoint: resume consuming (and commit) there."""
        return self._durable_cursor

    def delivered_through(self) -> int:
        return self._popped

    def restore_delivered_through(self, key: int) -> None:
        self._durable_popped = self._popped = max(key, 0)
        self._popped_at = self._popped >> _SHIFT

    @property
    def degraded(self) -> bool:
        """True while a storage operation failed and waits for a retry; indexes are in memory."""
        return bool(self._failing) or self._clear_pending

    def checkpoint(self, index_cursor: int) -> None:
        """Make adds and pops durable and record index_cursor, in one atomic batch.

        On a storage failure the tracker degrades instead of raising: `index_cursor()` keeps
        the last durable cursor, which is what the caller must commit, and the next checkpoint
        retries with everything accumulated since.
        """
        if not self._ensure_cleared():
            return
        self._retry_deferred()
        popped = self._popped
        batch = SnapshotBatch(
            "checkpoint",
            partition_meta=self._partition_meta(index_cursor=index_cursor, delivered_through=popped),
        )
        wal_stored, mark = self._wal_stored, self._wal_mark
        logged = len(self._wal_offsets) + len(self._unsorted_offsets) - mark
        chunk: Segment | None = None
        if wal_stored + logged > max(4 * self._mutable_size(), _WAL_COMPACT_MIN):
            # Mostly delivered entries: rewrite the log with what is pending, so it stays small.
            keys = list(self._sorted_mutable())
            chunk = Segment(array("q", [k >> _SHIFT for k in keys]), array("Q", [k & _MASK for k in keys]))
            batch.wal_reset, wal_stored = True, len(keys)
        elif logged:
            at = self._wal_at + self._unsorted_at[mark:]
            offsets = self._wal_offsets + self._unsorted_offsets[mark:]
            chunk, wal_stored = Segment(at, offsets), wal_stored + logged
        if chunk is not None:
            batch.wal_append = (self._wal_seq, chunk)
            assert batch.partition_meta is not None
            batch.partition_meta.wal_seq = self._wal_seq + 1
        rewrites: list[tuple[_Bucket, BucketMeta, int]] = []
        for bucket in self._buckets:
            if bucket.pending and bucket.popped_since_bitmap > self._rewrite_ratio * bucket.stored:
                meta = dataclasses.replace(bucket.meta, first_segment=bucket.segment, bitmap_through=popped)
                bucket.bitmap.run_optimize()
                bitmap = bucket.bitmap.serialize()
                batch.buckets.append(BucketWrite(meta, bitmap))
                batch.delete_segments.append((bucket.bucket_id, bucket.meta.first_segment, bucket.segment))
                rewrites.append((bucket, meta, len(bitmap)))
        try:
            self._write(batch)
        except StorageError:
            return
        self._durable_cursor, self._durable_popped = index_cursor, popped
        if batch.wal_append is not None:
            self._wal_seq += 1
            self._wal_at, self._wal_offsets = array("q"), array("Q")
            self._wal_mark = len(self._unsorted_offsets)
        self._wal_stored = wal_stored
        self._mutable_popped.clear()
        for bucket, meta, bitmap_bytes in rewrites:
            bucket.meta, bucket.bitmap_bytes, bucket.popped_since_bitmap = meta, bitmap_bytes, 0
            bucket.stored = sum(meta.seg_count[meta.first_segment :])
        for bucket in [b for b in self._buckets if not b.pending]:
            if not self._delete_bucket(bucket):
                break

    def _delete_bucket(self, bucket: _Bucket) -> bool:
        """Delete a fully delivered bucket whose pops are durable."""
        ids = [b.bucket_id for b in self._buckets if b is not bucket]
        batch = SnapshotBatch("delete", partition_meta=self._partition_meta(bucket_ids=ids))
        batch.delete_buckets.append(bucket.bucket_id)
        try:
            self._write(batch)
        except StorageError:
            return False
        self._buckets.remove(bucket)
        del self._by_id[bucket.bucket_id]
        self._rebuild_heap()
        return True

    def _retry_deferred(self) -> None:
        """Retry a seal or merge that failed earlier (or is due after a config change)."""
        sealing = self._mutable_size() >= self._min_index_count and "create" in self._failing
        if sealing and not self._seal():
            return
        if len(self._buckets) > self._max_buckets:
            self._merge_over_limit(force=True)

    def clear(self) -> None:
        self._durable_popped = 0
        self._reset_memory()
        self._durable_cursor = None
        self._failing.clear()
        self._clear_pending = True
        self._ensure_cleared()

    def close(self) -> None:
        self._reset_memory()

    # -- sealing and merging ----------------------------------------------------------------

    def _seal_and_merge(self, now: int) -> None:
        if self._failing & {"create", "merge", "clear"} and now < self._retry_at:
            return
        if self._seal():
            self._merge_over_limit()

    def seal(self) -> bool:
        """Seal the mutable bucket now (normally done by add); False if storage failed."""
        if not self._mutable_size():
            return True
        return self._seal() and self._merge_over_limit(force=True)

    def _seal(self) -> bool:
        if not self._mutable_size() and not self._mutable_popped:
            return True
        if not self._ensure_cleared():
            return False
        started = time.perf_counter()
        pending_keys = list(self._mutable)
        if self._unsorted_offsets:
            pending_keys += [d << _SHIFT | o for d, o in zip(self._unsorted_at, self._unsorted_offsets, strict=True)]
            pending_keys.sort()
        popped_keys = _latest_per_offset(self._mutable_popped, self._mutable_bitmap)
        keys = popped_keys + pending_keys if popped_keys else pending_keys
        if not keys:
            # Only superseded pops: nothing to snapshot, the mutable bucket stays as it is.
            return True
        segments = _cut(keys, self._step, self._max_per_segment)
        bitmap = self._mutable_bitmap
        bitmap.run_optimize()
        if popped_keys:
            stored = bitmap.copy()
            stored.update(array("Q", [k & _MASK for k in popped_keys]))
            stored.run_optimize()
        else:
            stored = bitmap
        raw_bitmap = stored.serialize()
        bucket_id = self._next_bucket_id
        meta = _bucket_meta(bucket_id, segments, stored.min(), stored.max())
        numbered = dict(enumerate(segments))
        batch = SnapshotBatch(
            "create",
            partition_meta=self._partition_meta(
                bucket_ids=[b.bucket_id for b in self._buckets] + [bucket_id], next_bucket_id=bucket_id + 1
            ),
            buckets=[BucketWrite(meta, raw_bitmap, numbered)],
            wal_reset=True,
        )
        try:
            self._write(batch)
        except StorageError:
            return False
        bucket = _Bucket(meta, bitmap, len(pending_keys), len(raw_bitmap))
        head = self._activate(bucket, numbered)
        self._next_bucket_id = bucket_id + 1
        self._buckets.append(bucket)
        self._by_id[bucket_id] = bucket
        if head != _NO_KEY:
            heapq.heappush(self._heap, (head, bucket_id))
        self._sealed_max_offset = max(self._sealed_max_offset, meta.max_offset)
        self._mutable = SortedList()
        self._clear_unsorted()
        self._mutable_count = 0
        self._mutable_bitmap = BitMap64()
        self._mutable_max_offset = -1
        self._mutable_popped = []
        self._wal_at, self._wal_offsets, self._wal_stored = array("q"), array("Q"), 0
        _release_memory()
        logger.info(
            "bucket sealed partition=%s bucket=%d entries=%d segments=%d ms=%.1f",
            self._partition,
            bucket_id,
            len(keys),
            len(segments),
            (time.perf_counter() - started) * 1000,
        )
        return True

    def merge(self) -> bool:
        """Merge the best run of adjacent buckets now (normally done past max_buckets)."""
        if len(self._buckets) < 2:
            return True
        try:
            self._merge_run(*self._best_run())
        except StorageError:
            return False
        return True

    def _best_run(self) -> tuple[int, int]:
        """(index, width) of the adjacent buckets to merge next, after Pulsar's selectMergedBuckets.

        Up to _MAX_MERGE buckets, fewest pending messages first, then the earliest next entry.
        Never all of them (unless there are only two): with max_buckets at 1 to 3, merging every
        bucket would rewrite the whole index at each seal, where leaving one out lets the choice
        skip the largest.
        """
        buckets = self._buckets
        width = max(2, min(_MAX_MERGE, len(buckets) - 1))
        return min(
            range(len(buckets) - width + 1),
            key=lambda i: (
                sum(b.pending for b in buckets[i : i + width]),
                min(b.head() for b in buckets[i : i + width]),
            ),
        ), width

    def _merge_over_limit(self, force: bool = False) -> bool:
        if not force and self._failing & {"merge", "load"} and self.clock.now_ms() < self._retry_at:
            return False
        while len(self._buckets) > self._max_buckets:
            try:
                self._merge_run(*self._best_run())
            except StorageError:
                return False
        return True

    def _reader(self, bucket: _Bucket) -> _SegmentReader:
        def load(first: int, end: int) -> list[Segment]:
            return self._with_retries(
                "load", lambda: self._storage.load_segments(self._partition, bucket.bucket_id, first, end)
            )

        return _SegmentReader(load, bucket.meta.segment_count)

    def _merge_run(self, index: int, width: int) -> None:
        """Merge buckets index .. index + width - 1 into one, in one batch; raise StorageError on failure.

        Every entry later than the durable delivery point is rewritten, including popped ones a
        checkpoint has not made durable yet: a merge must not turn a pop into a loss. Segments
        are merged window by window (each source's segments of a window are sorted runs), and
        read a chunk at a time, so memory holds the merged bucket but not every source too.
        """
        if not self._ensure_cleared():
            raise StorageError("a clear is pending")
        started = time.perf_counter()
        sources = self._buckets[index : index + width]
        durable, popped, step = self._durable_popped, self._popped, self._step
        readers = [self._reader(bucket) for bucket in sources]

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
            drop = set(undelivered) - set(_latest_per_offset(undelivered, pending))
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
                for segment in _cut(merged_keys, step, self._max_per_segment):
                    stored.update(segment.offsets)
                    segments.append(segment)
                merged_keys = []
        ids = [b.bucket_id for b in self._buckets]
        batch = SnapshotBatch("merge", delete_buckets=[b.bucket_id for b in sources])
        merged: _Bucket | None = None
        numbered = dict(enumerate(segments))
        if segments:
            bucket_id = self._next_bucket_id
            ids[index : index + width] = [bucket_id]
            stored.run_optimize()
            raw_bitmap = stored.serialize()
            meta = _bucket_meta(
                bucket_id,
                segments,
                min(b.meta.min_offset for b in sources),
                max(b.meta.max_offset for b in sources),
            )
            batch.buckets.append(BucketWrite(meta, raw_bitmap, numbered))
            batch.partition_meta = self._partition_meta(bucket_ids=ids, next_bucket_id=bucket_id + 1)
            pending.run_optimize()
            merged = _Bucket(meta, pending, sum(b.pending for b in sources), len(raw_bitmap))
        else:
            del ids[index : index + width]
            batch.partition_meta = self._partition_meta(bucket_ids=ids)
        self._write(batch)
        for bucket in sources:
            del self._by_id[bucket.bucket_id]
        if merged is not None:
            self._activate(merged, numbered)
            self._buckets[index : index + width] = [merged]
            self._by_id[merged.bucket_id] = merged
            self._next_bucket_id = merged.bucket_id + 1
        else:
            del self._buckets[index : index + width]
        self._rebuild_heap()
        _release_memory()
        logger.info(
            "buckets merged partition=%s buckets=%s into=%s entries=%d segments=%d ms=%.1f",
            self._partition,
            ",".join(str(b.bucket_id) for b in sources),
            merged.bucket_id if merged is not None else "none",
            sum(len(s) for s in segments),
            len(segments),
            (time.perf_counter() - started) * 1000,
        )

    # -- metrics ----------------------------------------------------------------------------

    def stats(self) -> TrackerStats:
        loaded = self._mutable_size() + sum(len(b.offsets) - b.pos for b in self._buckets)
        failing = set(self._failing) | ({"clear"} if self._clear_pending else set())
        return TrackerStats(
            delayed=self._count,
            buckets=len(self._buckets),
            mutable_indexes=self._mutable_size(),
            loaded_indexes=loaded,
            snapshot_bytes=sum(b.snapshot_bytes for b in self._buckets),
            degraded=bool(failing),
            degraded_ops=tuple(sorted(failing)),
            ops=dict(self._ops),
        )
