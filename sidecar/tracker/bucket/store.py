"""One partition's durable state: its root record as storage holds it, and the calls that change it.

Every change the tracker makes is one atomic batch that carries the partition's root record, so
the root record's fields live here, next to the calls that write it.

Storage failures must not drop an index. A call is retried a few times with backoff; when it
still fails, its kind is marked failing, the tracker keeps the index in memory and retries the
operation after `retry_interval_ms`, and the tracker reports itself degraded until a call of
that kind succeeds. Pulsar retries its snapshot calls the same way (executeWithRetry).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from pyroaring import BitMap64

from sidecar.clock import Clock
from sidecar.errors import StorageError
from sidecar.tracker.bucket.stats import TrackerListener
from sidecar.tracker.storage.base import BucketMeta, OpKind, PartitionMeta, Segment, SnapshotBatch, SnapshotStorage

T = TypeVar("T")


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def release_memory() -> None:
    """Give the heap freed by a seal or merge back to the OS (glibc keeps it otherwise).

    A seal or merge builds its segments, their encoding and RocksDB's write batch at once, then
    drops them; without this the process keeps that peak, and resident memory would grow with
    the largest merge rather than stay bounded by what the tracker holds.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class PartitionStore:
    """One partition's view of a SnapshotStorage shared by partitions."""

    def __init__(
        self,
        storage: SnapshotStorage,
        partition: str,
        clock: Clock,
        listener: TrackerListener,
        logger: logging.Logger,
        *,
        retries: int,
        backoff_s: float,
        retry_interval_ms: int,
    ) -> None:
        """`logger` is the tracker's, so that every tracker event is logged under one name."""
        self._storage = storage
        self.partition = partition
        self._clock = clock
        self._listener = listener
        self._logger = logger
        self._retries = retries
        self._backoff_s = backoff_s
        self._retry_interval_ms = retry_interval_ms
        self.durable_cursor: int | None = None
        self.delivered_through = 0
        """The packed key through which pops are durable (see PartitionMeta)."""
        self.lineage: tuple[str, ...] = ()
        """The group commits the durable state agrees with (see PartitionMeta)."""
        self.rules = ""
        """The intake rules of the commit point of the durable state (see PartitionMeta)."""
        self.next_bucket_id = 1
        self.wal_seq = 0
        self.ops: Counter[tuple[str, str]] = Counter()
        """Attempts by (kind, "succeed" | "failed")."""
        self.failing: set[str] = set()
        """Kinds whose last call failed after its retries."""
        self.retry_at = 0
        """When the tracker may try a failing kind again (clock milliseconds)."""
        self.clear_pending = False
        """A clear whose delete failed: nothing else may be written before it is done."""

    # -- the root record --------------------------------------------------------------------

    def root(self, bucket_ids: list[int], **changes: object) -> PartitionMeta:
        """The root record as it is durable now, with the changes the batch being built makes."""
        meta = PartitionMeta(
            partition=self.partition,
            index_cursor=self.durable_cursor,
            delivered_through=self.delivered_through,
            bucket_ids=bucket_ids,
            next_bucket_id=self.next_bucket_id,
            wal_seq=self.wal_seq,
            lineage=self.lineage,
            rules=self.rules,
        )
        return dataclasses.replace(meta, **changes)  # type: ignore[arg-type]

    # -- recovery reads: not retried, a failure stops the start ----------------------------

    def recover_root(self) -> PartitionMeta | None:
        """Read the root record and take its fields; None when the partition has no state yet."""
        meta = self._storage.load_partition(self.partition)
        if meta is not None:
            self.durable_cursor = meta.index_cursor
            self.delivered_through = meta.delivered_through
            self.next_bucket_id = meta.next_bucket_id
            self.wal_seq = meta.wal_seq
            self.lineage = meta.lineage
            self.rules = meta.rules
        return meta

    def load_bucket(self, bucket_id: int) -> tuple[BucketMeta, BitMap64, int]:
        """A bucket's metadata, its stored bitmap and the bitmap's size in bytes."""
        meta, raw_bitmap = self._storage.load_bucket(self.partition, bucket_id)
        try:
            bitmap = BitMap64.deserialize(raw_bitmap)
        except Exception as exc:
            raise StorageError(
                f"the bitmap of bucket {bucket_id} of partition {self.partition!r} in "
                f"{self._storage.location} is unreadable ({exc}). Move the state dir aside and "
                "restart to rebuild from the committed Kafka offsets."
            ) from exc
        return meta, bitmap, len(raw_bitmap)

    def load_wal(self) -> list[Segment]:
        return self._storage.load_wal(self.partition)

    # -- retried calls ----------------------------------------------------------------------

    def call(self, kind: OpKind, action: Callable[[], T]) -> T:
        """Run a storage call, retrying; on final failure mark `kind` degraded and re-raise."""
        delay = self._backoff_s
        for attempt in range(self._retries + 1):
            started = time.perf_counter()
            try:
                result = action()
            except StorageError as exc:
                self._record(kind, False, time.perf_counter() - started)
                if attempt == self._retries:
                    self.failing.add(kind)
                    self.retry_at = self._clock.now_ms() + self._retry_interval_ms
                    self._logger.warning(
                        "tracker storage op failed, degraded partition=%s op=%s attempts=%d error=%s",
                        self.partition,
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
            self.failing.discard(kind)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _record(self, kind: str, ok: bool, seconds: float) -> None:
        self.ops[(kind, "succeed" if ok else "failed")] += 1
        self._listener.on_op(kind, ok, seconds)

    def write(self, batch: SnapshotBatch) -> int:
        return self.call(batch.kind, lambda: self._storage.write(self.partition, batch))

    def load_segment(self, bucket_id: int, number: int) -> Segment:
        return self.call("load", lambda: self._storage.load_segment(self.partition, bucket_id, number))

    def load_segments(self, bucket_id: int, first: int, end: int) -> list[Segment]:
        return self.call("load", lambda: self._storage.load_segments(self.partition, bucket_id, first, end))

    def clear(self) -> None:
        """Delete the partition's state; if that fails, it is retried before any other write."""
        self.durable_cursor, self.lineage, self.rules = None, (), ""
        self.failing.clear()
        self.clear_pending = True
        self.ensure_cleared()

    def ensure_cleared(self) -> bool:
        """Finish a clear() whose storage delete failed; False while it still fails."""
        if not self.clear_pending:
            return True
        try:
            self.write(SnapshotBatch("clear", clear_partition=True))
        except StorageError:
            return False
        self.clear_pending = False
        return True
