"""The key index of a keyed partition (`by_key: replace`): each key's newest record, on disk.

A million keys would cost a Python dict about 100 bytes each; the index lives in the state dir's
RocksDB instead, beside the bucket index, under the partition's prefix, so that a clear of the
partition clears it too. What memory holds is the keys written since the last checkpoint: they go
to disk in the checkpoint's own batch, with the cursor past their records, so after a crash the
index and the cursor agree, and the log from the cursor on puts the rest back.
"""

from collections.abc import Sequence

from sidecar.policy.by_key import Pending
from sidecar.tracker.storage.base import KeyEntry, SnapshotStorage


class MemoryKeys:
    """policy.by_key.KeyIndex in a dict: for the in-memory tracker, lost with it."""

    def __init__(self) -> None:
        self._keys: dict[bytes, Pending] = {}

    def get(self, key: bytes) -> Pending | None:
        return self._keys.get(key)

    def put(self, key: bytes, pending: Pending) -> None:
        self._keys[key] = pending

    def prefetch(self, keys: Sequence[bytes | None]) -> None:
        """Nothing to read ahead: all of it is in memory."""


class StoredKeys:
    """policy.by_key.KeyIndex over the snapshot storage, for one partition."""

    def __init__(self, storage: SnapshotStorage, partition: str) -> None:
        self._storage = storage
        self._partition = partition
        self._unwritten: dict[bytes, KeyEntry] = {}
        self._read: dict[bytes, KeyEntry | None] = {}
        """What `prefetch` read for the slice being taken."""

    def prefetch(self, keys: Sequence[bytes | None]) -> None:
        """Read the slice's keys that memory does not hold in one go (a multi-get): one point
        lookup per record was half of the keyed step's time (docs/benchmarks.md)."""
        wanted = list({key for key in keys if key and key not in self._unwritten})
        self._read = dict(zip(wanted, self._storage.load_keys(self._partition, wanted), strict=True))

    def get(self, key: bytes) -> Pending | None:
        entry = self._unwritten.get(key)
        if entry is None:
            entry = self._read[key] if key in self._read else self._storage.load_key(self._partition, key)
        return None if entry is None else Pending(*entry)

    def put(self, key: bytes, pending: Pending) -> None:
        self._unwritten[key] = (pending.offset, pending.deliver_at)

    def take_unwritten(self) -> dict[bytes, KeyEntry]:
        """The keys to write with the next checkpoint's batch; memory forgets them."""
        unwritten, self._unwritten, self._read = self._unwritten, {}, {}
        return unwritten

    def unwritten_back(self, keys: dict[bytes, KeyEntry]) -> None:
        """A checkpoint that took `keys` failed to write them: they wait for the next one."""
        self._unwritten = {**keys, **self._unwritten}

    def forget_unwritten(self) -> None:
        """The partition's index is cleared (a rebuild starts): what was not written goes too."""
        self._unwritten = {}

    def __len__(self) -> int:
        """Keys held in memory: those written since the last checkpoint."""
        return len(self._unwritten)
