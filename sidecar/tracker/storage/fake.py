"""In-memory snapshot storage with fault injection, for tests.

It stores the same bytes under the same keys as the RocksDB adapter, so it tests the encoding
too; what it adds is the power to make the next N operations of a kind fail, which is how the
tests check that a failed create, load or delete is retried or degraded without losing an index.
A "crash" is simply building a new tracker over the same fake: only what a batch committed is
there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from sortedcontainers import SortedDict

from sidecar.errors import StorageError
from sidecar.tracker.storage.base import KeyEntry, OpKind, Segment, SnapshotBatch
from sidecar.tracker.storage.kv import KeyValueSnapshotStorage, Op


class FakeSnapshotStorage(KeyValueSnapshotStorage):
    def __init__(self, owner: str | None = None) -> None:
        self.location = "fake snapshot storage"
        self._data: SortedDict = SortedDict()
        self._faults: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        """Attempts per operation kind, failed ones included."""
        self.last_sync: bool | None = None
        """Whether the last committed batch asked to be durable before returning."""
        self._check_marker(owner)

    def fail(self, kind: OpKind, count: int = 1) -> None:
        """Make the next `count` operations of this kind raise StorageError."""
        self._faults[kind] += count

    def heal(self) -> None:
        self._faults.clear()

    def _maybe_fail(self, kind: str) -> None:
        self.calls[kind] += 1
        if self._faults[kind] > 0:
            self._faults[kind] -= 1
            raise StorageError(f"injected {kind} fault")

    def write(self, partition: str, batch: SnapshotBatch) -> int:
        self._maybe_fail(batch.kind)
        return super().write(partition, batch)

    def sync(self) -> None:
        self._maybe_fail("sync")

    def load_segment(self, partition: str, bucket_id: int, segment: int) -> Segment:
        self._maybe_fail("load")
        return super().load_segment(partition, bucket_id, segment)

    def load_segments(self, partition: str, bucket_id: int, first: int, end: int) -> list[Segment]:
        self._maybe_fail("load")
        return super().load_segments(partition, bucket_id, first, end)

    @property
    def key_count(self) -> int:
        return len(self._data)

    def stored_keys(self) -> list[bytes]:
        return list(self._data.keys())

    def _get(self, key: bytes) -> bytes | None:
        value: bytes | None = self._data.get(key)
        return value

    def _scan(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        for key in list(self._data.irange(start, end, inclusive=(True, False))):
            yield key, self._data[key]

    def write_keys(self, partition: str, entries: Mapping[bytes, KeyEntry]) -> None:
        self._maybe_fail("keys")
        super().write_keys(partition, entries)

    def _put_unlogged(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        self._data.update(items)

    def _commit(self, ops: list[Op], sync: bool = True) -> None:
        self.last_sync = sync
        for kind, key, value in ops:
            if kind == "put":
                self._data[key] = value
            elif kind == "del":
                self._data.pop(key, None)
            else:
                for stale in list(self._data.irange(key, value, inclusive=(True, False))):
                    del self._data[stale]
