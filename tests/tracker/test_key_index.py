"""The key index of keyed partitions (tracker/keys.py) on RocksDB and on the fake, which share the
layout (tracker/storage/kv.py): written with a checkpoint's batch, read back after a reopen, gone
with a clear of its partition, and apart from other partitions."""

from pathlib import Path

import pytest

from sidecar.errors import StorageError
from sidecar.policy.by_key import Pending
from sidecar.tracker.keys import StoredKeys
from sidecar.tracker.storage import FakeSnapshotStorage, RocksDbSnapshotStorage, SnapshotBatch
from sidecar.tracker.storage.base import SnapshotStorage


def open_store(kind: str, path: Path) -> SnapshotStorage:
    return RocksDbSnapshotStorage(path / "index") if kind == "rocksdb" else FakeSnapshotStorage()


@pytest.mark.parametrize("kind", ["fake", "rocksdb"])
def test_keys_go_to_disk_with_the_checkpoint_and_are_read_through_memory(tmp_path: Path, kind: str) -> None:
    storage = open_store(kind, tmp_path)
    keys = StoredKeys(storage, "orders/0")
    keys.put(b"user-1", Pending(10, 5_000))
    keys.put(b"\x00\xff binary", Pending(11, None))
    keys.put(b"user-1", Pending(12, 7_000))  # the newest wins
    assert keys.get(b"user-1") == Pending(12, 7_000) and len(keys) == 2
    assert storage.load_key("orders/0", b"user-1") is None  # not written until a checkpoint
    storage.write("orders/0", SnapshotBatch("checkpoint", keys=keys.take_unwritten()))
    assert len(keys) == 0
    assert keys.get(b"user-1") == Pending(12, 7_000)
    assert keys.get(b"\x00\xff binary") == Pending(11, None)
    assert keys.get(b"user-2") is None
    assert StoredKeys(storage, "orders/1").get(b"user-1") is None  # another partition's keys are apart
    if kind == "rocksdb":
        storage.sync()
        storage.close()
        storage = open_store(kind, tmp_path)
        assert StoredKeys(storage, "orders/0").get(b"user-1") == Pending(12, 7_000)
    storage.write("orders/0", SnapshotBatch("clear", clear_partition=True))
    assert StoredKeys(storage, "orders/0").get(b"user-1") is None
    storage.close()


def test_a_key_entry_of_the_wrong_size_says_the_store_is_corrupt(tmp_path: Path) -> None:
    storage = FakeSnapshotStorage()
    storage.write("t/0", SnapshotBatch("checkpoint", keys={b"k": (1, 2)}))
    (stored,) = [k for k in storage.stored_keys() if k.endswith(b"\x00kk")]
    storage._commit([("put", stored, b"short")])
    with pytest.raises(StorageError, match="key of partition 't/0'"):
        storage.load_key("t/0", b"k")


@pytest.mark.parametrize("kind", ["fake", "rocksdb"])
def test_a_slice_prefetched_in_one_read_answers_as_single_reads_do(tmp_path: Path, kind: str) -> None:
    storage = open_store(kind, tmp_path)
    keys = StoredKeys(storage, "orders/0")
    for i in range(5):
        keys.put(b"k%d" % i, Pending(i, 1_000 + i))
    storage.write("orders/0", SnapshotBatch("checkpoint", keys=keys.take_unwritten()))
    keys.put(b"k1", Pending(9, None))  # newer than what is on disk
    keys.prefetch([b"k0", b"k1", None, b"k0", b"missing", b""])
    assert [keys.get(k) for k in (b"k0", b"k1", b"missing", b"k3")] == [
        Pending(0, 1_000),
        Pending(9, None),
        None,
        Pending(3, 1_003),  # k3: not prefetched, read alone
    ]
    keys.put(b"k0", Pending(20, 2_000))  # a put after the prefetch is what a get answers
    assert keys.get(b"k0") == Pending(20, 2_000)
    storage.close()
