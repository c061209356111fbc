"""The key index of a keyed partition (`by_key: replace`): each key's newest record, on disk.

A million keys would cost a Python dict about 100 bytes each; the index lives in the state dir's
RocksDB instead, beside the bucket index, under the partition's prefix, so that a clear of the
partition clears it too. Each slice of intake is written as it is read, without RocksDB's
write-ahead log: nothing in memory grows with the keys.

The index needs no durability of its own. A keyed partition is always read again from its
earliest pending record when its next owner starts (partitions/state.py: `read_again`, which
clears the index first), and the rule trusts no entry outside what the current reading read
(policy/by_key.py: `KeyStep.start`). So the keys are not part of a checkpoint, and a crash that
loses the last writes loses nothing the next reading would use.
"""

import logging
from collections.abc import Mapping, Sequence

from sidecar.errors import StorageError
from sidecar.policy.by_key import Entry
from sidecar.tracker.storage.base import SnapshotStorage

logger = logging.getLogger(__name__)


class MemoryKeys:
    """policy.by_key.KeyIndex in a dict: for the in-memory tracker, lost with it."""

    def __init__(self) -> None:
        self._keys: dict[bytes, Entry] = {}

    def read(self, keys: Sequence[bytes]) -> list[Entry | None]:
        return [self._keys.get(key) for key in keys]

    def write(self, entries: Mapping[bytes, Entry]) -> None:
        self._keys.update(entries)


WRITE_AT = 2_000
"""Entries held until they are written: a slice of intake writes its keys at once, and a rebuild,
which takes one record at a time, writes them in batches of this many (one write a record cost it
four times the time of the rest of the keyed step)."""


class StoredKeys:
    """policy.by_key.KeyIndex over the snapshot storage, for one partition."""

    def __init__(self, storage: SnapshotStorage, partition: str) -> None:
        self._storage = storage
        self._partition = partition
        self._unwritten: dict[bytes, Entry] = {}
        """Entries not written yet (fewer than WRITE_AT, or a write failed): reads find them here."""

    def read(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """One multi-get for the keys memory does not hold: a point read per record was half of
        the keyed step's time (docs/benchmarks.md)."""
        unwritten = self._unwritten
        if not unwritten:
            return self._storage.load_keys(self._partition, list(keys))
        missing = [key for key in keys if key not in unwritten]
        found = dict(zip(missing, self._storage.load_keys(self._partition, missing), strict=True))
        return [unwritten[key] if key in unwritten else found[key] for key in keys]

    def write(self, entries: Mapping[bytes, Entry]) -> None:
        """A failed write keeps the entries in memory, where reads find them, until a later write
        takes them along: the rule goes on deciding from them (a key that lost its newest record
        would let a replaced one be delivered), as the bucket tracker goes on from memory."""
        unwritten = self._unwritten
        unwritten.update(entries)
        if len(unwritten) < WRITE_AT:
            return
        try:
            self._storage.write_keys(self._partition, unwritten)
        except StorageError as exc:
            logger.warning("key index write failed, kept in memory partition=%s keys=%d error=%s",
                           self._partition, len(unwritten), exc)  # fmt: skip
            return
        self._unwritten = {}

    def __len__(self) -> int:
        """Entries held in memory, not written yet."""
        return len(self._unwritten)
