"""The key index of keyed partitions (tracker/keys.py) on RocksDB and on the fake, which share the
layout (tracker/storage/kv.py): written once enough entries wait, read back in one read, gone
with a clear of its partition, apart from other partitions, and kept in memory when a write fails."""

from pathlib import Path

import pytest

from sidecar.errors import StorageError
from sidecar.tracker import keys as keys_module
from sidecar.tracker.keys import StoredKeys
from sidecar.tracker.storage import FakeSnapshotStorage, RocksDbSnapshotStorage, SnapshotBatch
from sidecar.tracker.storage.kv import KeyValueSnapshotStorage


def open_store(kind: str, path: Path) -> KeyValueSnapshotStorage:
    return RocksDbSnapshotStorage(path / "index") if kind == "rocksdb" else FakeSnapshotStorage()


@pytest.mark.parametrize("kind", ["fake", "rocksdb"])
def test_entries_are_written_once_enough_wait_and_read_back_in_one_read(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keys_module, "WRITE_AT", 3)
    storage = open_store(kind, tmp_path)
    keys = StoredKeys(storage, "orders/0")
    keys.write({b"user-1": (10, 5_000), b"\x00\xff binary": (11, None)})
    assert len(keys) == 2 and storage.load_key("orders/0", b"user-1") is None  # held: fewer than WRITE_AT
    keys.write({b"user-1": (12, 7_000)})  # the newest wins
    assert keys.read([b"user-1", b"user-2", b"\x00\xff binary", b"user-1"]) == [
        (12, 7_000),
        None,
        (11, None),
        (12, 7_000),
    ]
    keys.write({b"user-3": (13, 8_000)})  # the third key: all of them go to the store
    assert len(keys) == 0
    assert [storage.load_key("orders/0", k) for k in (b"user-1", b"\x00\xff binary")] == [(12, 7_000), (11, None)]
    assert keys.read([b"user-3", b"user-1"]) == [(13, 8_000), (12, 7_000)]
    assert StoredKeys(storage, "orders/1").read([b"user-1"]) == [None]  # another partition's keys are apart
    storage.write("orders/0", SnapshotBatch("clear", clear_partition=True))
    assert keys.read([b"user-1"]) == [None]
    storage.close()


def test_a_key_entry_of_the_wrong_size_says_the_store_is_corrupt() -> None:
    storage = FakeSnapshotStorage()
    storage.write_keys("t/0", {b"k": (1, 2)})
    (stored,) = [k for k in storage.stored_keys() if k.endswith(b"\x00kk")]
    storage._commit([("put", stored, b"short")])
    with pytest.raises(StorageError, match="key of partition 't/0'"):
        storage.load_key("t/0", b"k")


def test_a_failed_write_keeps_the_entries_where_reads_find_them_until_a_write_takes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(keys_module, "WRITE_AT", 1)
    storage = FakeSnapshotStorage()
    keys = StoredKeys(storage, "orders/0")
    keys.write({b"a": (1, 100), b"b": (2, 200)})
    storage.fail("keys")  # type: ignore[arg-type]
    keys.write({b"a": (3, 300)})  # the disk refused it: the rule must still see a's newest record
    assert len(keys) == 1 and storage.load_key("orders/0", b"a") == (1, 100)
    assert keys.read([b"a", b"b"]) == [(3, 300), (2, 200)]
    keys.write({b"b": (4, None)})
    assert len(keys) == 0
    assert [storage.load_key("orders/0", k) for k in (b"a", b"b")] == [(3, 300), (4, None)]
