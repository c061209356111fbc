"""Snapshot storage: encodings, the RocksDB adapter in a tmp dir, and the operator-facing errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from array import array
from pathlib import Path

import pytest
import rocksdict

from sidecar.clock import ManualClock
from sidecar.errors import StorageError
from sidecar.tracker.storage import (
    BucketMeta,
    BucketWrite,
    FakeSnapshotStorage,
    PartitionMeta,
    RocksDbSnapshotStorage,
    Segment,
    SnapshotBatch,
)
from sidecar.tracker.storage.kv import (
    FORMAT_KEY,
    FORMAT_VERSION,
    decode_bucket_meta,
    decode_partition_meta,
    decode_segment,
    encode_bucket_meta,
    encode_partition_meta,
    encode_segment,
    partition_prefix,
)

from .conftest import make_tracker


def segment(*pairs: tuple[int, int]) -> Segment:
    return Segment(array("q", [p[0] for p in pairs]), array("Q", [p[1] for p in pairs]))


def bucket_write(bucket_id: int, *segments: Segment) -> BucketWrite:
    meta = BucketMeta(
        bucket_id=bucket_id,
        first_segment=0,
        bitmap_through=0,
        min_offset=0,
        max_offset=99,
        seg_min_at=array("q", [s.deliver_at[0] for s in segments]),
        seg_max_at=array("q", [s.deliver_at[-1] for s in segments]),
        seg_count=array("q", [len(s) for s in segments]),
    )
    return BucketWrite(meta, b"bitmap", dict(enumerate(segments)))


# -- encodings ---------------------------------------------------------------------------------


def test_encodings_round_trip() -> None:
    seg = segment((1_700_000_000_000, 5), (1_700_000_000_001, 2**63 - 1))
    assert decode_segment(encode_segment(seg)) == seg
    write = bucket_write(7, seg, segment((1_700_000_000_002, 9)))
    write.meta.bitmap_through = 123 << 64 | 456
    assert decode_bucket_meta(encode_bucket_meta(write.meta)) == write.meta
    meta = PartitionMeta("a/1", 42, 99 << 64 | 3, [1, 4], 5, 8)
    assert decode_partition_meta(encode_partition_meta(meta)) == meta


def test_a_store_written_with_monotone_runs_pending_has_no_cursor() -> None:
    """Run members (--monotone-runs, since removed) are in no bucket: a cursor would skip them. Without
    one the index is set aside and the partition rebuilt from its commit. No run pending: as it was."""
    doc = json.loads(encode_partition_meta(PartitionMeta("a/1", 42, 99 << 64 | 3, [1, 4], 5, 8)))
    assert decode_partition_meta(json.dumps({**doc, "runs": "[[50,1000,60,1010,64]]"}).encode()).index_cursor is None
    assert decode_partition_meta(json.dumps({**doc, "runs": "[]"}).encode()).index_cursor == 42


def test_partition_prefixes_do_not_overlap() -> None:
    a, b = partition_prefix("t/1"), partition_prefix("t/10")
    assert not b.startswith(a) and not a.startswith(b)
    with pytest.raises(ValueError, match="NUL"):
        partition_prefix("bad\x00name")


# -- RocksDB adapter ---------------------------------------------------------------------------


def test_rocksdb_batch_and_reopen(tmp_path: Path) -> None:
    storage = RocksDbSnapshotStorage(tmp_path / "state")
    seg = segment((10, 1), (20, 2))
    batch = SnapshotBatch(
        "create",
        partition_meta=PartitionMeta("t/0", None, 0, [1], 2, 1),
        buckets=[bucket_write(1, seg)],
        wal_append=(0, segment((30, 3))),
    )
    assert storage.write("t/0", batch) > 0
    storage.close()
    reopened = RocksDbSnapshotStorage(tmp_path / "state")
    meta = reopened.load_partition("t/0")
    assert meta is not None and meta.bucket_ids == [1]
    bucket, bitmap = reopened.load_bucket("t/0", 1)
    assert bitmap == b"bitmap" and list(bucket.seg_count) == [2]
    assert reopened.load_segment("t/0", 1, 0) == seg
    assert reopened.load_wal("t/0") == [segment((30, 3))]
    assert reopened.load_partition("t/1") is None
    reopened.write("t/0", SnapshotBatch("delete", delete_buckets=[1], wal_reset=True))
    with pytest.raises(StorageError, match="segment 0 of bucket 1"):
        reopened.load_segment("t/0", 1, 0)
    assert reopened.load_wal("t/0") == []
    reopened.close()


def test_only_clears_are_synced_on_write() -> None:
    """A checkpoint is made durable by the one sync() after all partitions' checkpoints (checkpoint.py);
    a seal, merge or delete by the sync after the next checkpoint, which covers the writes before it."""
    clock, storage = ManualClock(1_000_000), FakeSnapshotStorage()
    tracker = make_tracker(clock, storage, max_buckets=1)
    for i in range(11):
        tracker.add(i, clock.now_ms() + 10 + i)
    assert storage.calls["create"] == 1 and storage.last_sync is False
    tracker.checkpoint(11)
    assert storage.calls["checkpoint"] == 1 and storage.last_sync is False
    for i in range(11, 21):
        tracker.add(i, clock.now_ms() + 10 + i)
    assert tracker.seal() and storage.calls["merge"] == 2 and storage.last_sync is False
    clock.advance(100)
    assert len(tracker.pop_due(100)) == 21
    tracker.checkpoint(21)
    assert storage.calls["delete"] == 1 and storage.last_sync is False
    tracker.clear()
    assert storage.calls["clear"] == 1 and storage.last_sync is True
    assert storage.calls["sync"] == 0  # the tracker never syncs: its caller does, once for all partitions


_WRITER = textwrap.dedent(
    """
    import sys
    from array import array
    from sidecar.tracker.storage import RocksDbSnapshotStorage, SnapshotBatch, PartitionMeta, Segment
    from sidecar.tracker.storage.base import BucketWrite, BucketMeta
    storage = RocksDbSnapshotStorage(sys.argv[1], sync=False)
    print("ready", flush=True)
    generation = 0
    while True:
        generation += 1
        chunk = Segment(array("q", [generation] * 200), array("Q", range(200)))
        batch = SnapshotBatch("checkpoint", partition_meta=PartitionMeta("t/0", generation, 0, [], 1, generation))
        batch.wal_reset = True
        batch.wal_append = (generation, chunk)
        storage.write("t/0", batch)
    """
)


def test_rocksdb_batch_is_atomic_across_a_kill(tmp_path: Path) -> None:
    """Kill a writer mid-stream: the WAL and the root record always agree (one whole batch)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "state")], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    storage = RocksDbSnapshotStorage(tmp_path / "state")
    meta = storage.load_partition("t/0")
    assert meta is not None and meta.index_cursor is not None and meta.index_cursor > 1
    (chunk,) = storage.load_wal("t/0")
    assert set(chunk.deliver_at) == {meta.index_cursor} and len(chunk) == 200
    storage.close()


def test_rocksdb_sync_runs_beside_writes_from_another_thread(tmp_path: Path) -> None:
    """The checkpoint syncs in a thread while the loop goes on writing: neither call may fail or
    wait for the other, and every batch is there after a reopen."""
    storage = RocksDbSnapshotStorage(tmp_path / "state")
    stop, errors, syncs = threading.Event(), [], [0]

    def sync_until_stopped() -> None:
        try:
            while not stop.is_set():
                storage.sync()
                syncs[0] += 1
        except Exception as e:  # reported below: a failure in the thread must fail the test
            errors.append(e)

    thread = threading.Thread(target=sync_until_stopped)
    thread.start()
    try:
        for generation in range(1, 501):
            chunk = Segment(array("q", [generation] * 50), array("Q", range(50)))
            batch = SnapshotBatch("checkpoint", partition_meta=PartitionMeta("t/0", generation, 0, [], 1, generation))
            batch.wal_reset, batch.wal_append = True, (generation, chunk)
            storage.write("t/0", batch)
    finally:
        stop.set()
        thread.join(30)
    assert not errors and syncs[0] > 0
    storage.sync()
    storage.close()
    reopened = RocksDbSnapshotStorage(tmp_path / "state")
    meta = reopened.load_partition("t/0")
    assert meta is not None and meta.index_cursor == 500
    reopened.close()


def test_rocksdb_sync_failure_says_what_to_do(tmp_path: Path) -> None:
    storage = RocksDbSnapshotStorage(tmp_path / "state")
    storage.close()
    with pytest.raises(StorageError, match=r"RocksDB sync failed in state dir .*Check free disk space"):
        storage.sync()


def test_rocksdb_open_waits_for_lock(tmp_path: Path) -> None:
    first = RocksDbSnapshotStorage(tmp_path / "state")
    closed = threading.Event()

    def close_first() -> None:
        first.close()
        closed.set()

    threading.Timer(0.5, close_first).start()
    second = RocksDbSnapshotStorage(tmp_path / "state", lock_timeout_s=60)
    assert closed.is_set()  # it opened because the first one let go, not before
    second.close()


def test_rocksdb_lock_timeout_says_what_to_do(tmp_path: Path) -> None:
    first = RocksDbSnapshotStorage(tmp_path / "state")
    with pytest.raises(StorageError, match=r"still locked.*another sidecar process"):
        RocksDbSnapshotStorage(tmp_path / "state", lock_timeout_s=0.5)
    first.close()


def test_rocksdb_lock_held_by_another_process(tmp_path: Path) -> None:
    holder = textwrap.dedent(
        """
        import sys, time
        from sidecar.tracker.storage import RocksDbSnapshotStorage
        s = RocksDbSnapshotStorage(sys.argv[1])
        print("ready", flush=True)
        time.sleep(1.0)
        s.close()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path / "s")], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    storage = RocksDbSnapshotStorage(tmp_path / "s", lock_timeout_s=60)
    storage.close()
    proc.wait()


def test_dir_that_is_not_a_rocksdb(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StorageError, match=r"holds no RocksDB.*empty or dedicated directory"):
        RocksDbSnapshotStorage(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is a file"):
        RocksDbSnapshotStorage(tmp_path / "file")


def test_a_creation_cut_short_by_kill_9_is_created_again_not_refused(tmp_path: Path) -> None:
    """CI (the churn run at d19a240): a sidecar killed while it created its index left exactly these
    files, no CURRENT yet, and every later start refused the state dir as "not a tracker state dir"
    (exit 2). They hold no data; RocksDB creates the store over them. Anything else still refuses."""
    index = tmp_path / "index"
    index.mkdir()
    for name, data in (("LOCK", b""), ("LOG", b"x" * 66), ("000000.dbtmp", b"x" * 36),
                       ("rocksdict-config.json", b"{}")):  # fmt: skip
        (index / name).write_bytes(data)
    storage = RocksDbSnapshotStorage(index)
    storage.close()
    assert (index / "CURRENT").exists()
    (tmp_path / "data").mkdir()
    for name in ("LOCK", "000007.sst"):  # a table file is data: not a creation cut short
        (tmp_path / "data" / name).write_bytes(b"x")
    with pytest.raises(StorageError, match=r"holds no RocksDB"):
        RocksDbSnapshotStorage(tmp_path / "data")


def test_corrupt_rocksdb(tmp_path: Path) -> None:
    RocksDbSnapshotStorage(tmp_path / "state").close()
    for name in os.listdir(tmp_path / "state"):
        if name.startswith("MANIFEST"):
            (tmp_path / "state" / name).write_bytes(b"\x00garbage" * 100)
    with pytest.raises(StorageError, match=r"corrupt or not a RocksDB.*move the state dir aside"):
        RocksDbSnapshotStorage(tmp_path / "state", lock_timeout_s=1)


def test_foreign_rocksdb(tmp_path: Path) -> None:
    db = rocksdict.Rdict(str(tmp_path / "other"), rocksdict.Options(raw_mode=True))
    db[b"user:1"] = b"somebody else's data"
    db.close()
    with pytest.raises(StorageError, match="not written by the delay sidecar"):
        RocksDbSnapshotStorage(tmp_path / "other")


def test_foreign_format_version_and_owner(tmp_path: Path) -> None:
    RocksDbSnapshotStorage(tmp_path / "s", owner="cluster-a").close()
    with pytest.raises(StorageError, match=r"belongs to 'cluster-a'.*own state dir"):
        RocksDbSnapshotStorage(tmp_path / "s", owner="cluster-b")
    RocksDbSnapshotStorage(tmp_path / "s", owner="cluster-a").close()
    db = rocksdict.Rdict(str(tmp_path / "s"), rocksdict.Options(raw_mode=True))
    db[FORMAT_KEY] = b'{"format": "delay-sidecar/bucket-tracker", "version": 99, "owner": null}'
    db.close()
    with pytest.raises(StorageError, match=rf"version 99.*this sidecar reads version {FORMAT_VERSION}"):
        RocksDbSnapshotStorage(tmp_path / "s")


def test_state_dir_of_format_version_1_is_refused(tmp_path: Path) -> None:
    """Version 1 kept per-segment offset columns; its state dir is moved aside, not misread."""
    RocksDbSnapshotStorage(tmp_path / "s").close()
    db = rocksdict.Rdict(str(tmp_path / "s"), rocksdict.Options(raw_mode=True))
    db[FORMAT_KEY] = b'{"format": "delay-sidecar/bucket-tracker", "version": 1, "owner": null}'
    db.close()
    assert FORMAT_VERSION == 2
    with pytest.raises(StorageError, match=r"version 1; this sidecar reads version 2.*move the state dir aside"):
        RocksDbSnapshotStorage(tmp_path / "s")


def test_bucket_meta_bounds_keys_by_deliver_at() -> None:
    """Without offset columns, a segment's key bounds span every offset at its first/last deliver-at."""
    write = bucket_write(1, segment((10, 7), (20, 3)), segment((30, 1)))
    meta = write.meta
    assert meta.min_key(0) == 10 << 64 and meta.max_key(0) == (20 << 64) + (1 << 64) - 1
    assert meta.min_key(0) <= 10 << 64 | 7 and meta.max_key(0) >= 20 << 64 | 3 and meta.max_key(0) < meta.min_key(1)


@pytest.mark.parametrize("kind", ["fake", "rocksdb"])
def test_load_segments_reads_a_range(tmp_path: Path, kind: str) -> None:
    storage = FakeSnapshotStorage() if kind == "fake" else RocksDbSnapshotStorage(tmp_path / "s", sync=False)
    segments = [segment((10 * n, n), (10 * n + 1, 100 + n)) for n in range(5)]
    other = [segment((1, 1))]
    batch = SnapshotBatch("create", buckets=[bucket_write(1, *segments), bucket_write(2, *other)])
    storage.write("t/0", batch)
    assert storage.load_segments("t/0", 1, 0, 5) == segments
    assert storage.load_segments("t/0", 1, 2, 4) == segments[2:4]
    assert storage.load_segments("t/0", 2, 0, 1) == other
    storage.write("t/0", SnapshotBatch("checkpoint", delete_segments=[(1, 3, 4)]))
    with pytest.raises(StorageError, match="segment 3 of bucket 1"):
        storage.load_segments("t/0", 1, 2, 5)
    with pytest.raises(StorageError, match="segment 0 of bucket 3"):
        storage.load_segments("t/0", 3, 0, 2)
    if isinstance(storage, FakeSnapshotStorage):
        storage.fail("load")
        with pytest.raises(StorageError, match="injected load fault"):
            storage.load_segments("t/0", 1, 0, 2)
    storage.close()


def test_data_of_another_partition(tmp_path: Path) -> None:
    storage = FakeSnapshotStorage()
    meta = PartitionMeta("orders/1")
    storage._commit([("put", partition_prefix("orders/2") + b"m", encode_partition_meta(meta))])
    with pytest.raises(StorageError, match=r"names partition 'orders/1'.*Move it aside"):
        storage.load_partition("orders/2")


def test_corrupt_partition_record(tmp_path: Path) -> None:
    storage = FakeSnapshotStorage()
    storage._commit([("put", partition_prefix("orders/2") + b"m", b"{not json")])
    with pytest.raises(StorageError, match=r"unreadable.*move the state dir aside"):
        make_tracker(ManualClock(), storage, "orders/2")


def test_tracker_over_rocksdb_survives_reopen(tmp_path: Path) -> None:
    clock = ManualClock(1_000_000)
    storage = RocksDbSnapshotStorage(tmp_path / "state")
    trackers = {p: make_tracker(clock, storage, p) for p in ("a/0", "a/1")}
    start = clock.now_ms()
    for i in range(100):
        for n, tracker in enumerate(trackers.values()):
            tracker.add(i, start + 10 + (i * 7 + n) % 300)
    for tracker in trackers.values():
        tracker.checkpoint(100)
        tracker.close()
    storage.close()
    storage = RocksDbSnapshotStorage(tmp_path / "state")
    for n, partition in enumerate(("a/0", "a/1")):
        tracker = make_tracker(clock, storage, partition)
        assert tracker.index_cursor() == 100 and len(tracker) == 100
        clock.set(start + 400)
        got = tracker.pop_due(1000)
        assert got == sorted(got) and sorted(d.offset for d in got) == list(range(100))
        assert all(d.deliver_at == start + 10 + (d.offset * 7 + n) % 300 for d in got)
        clock.set(start)
    storage.close()
