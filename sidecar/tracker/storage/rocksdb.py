"""RocksDB adapter of the snapshot storage (rocksdict, raw byte keys).

One RocksDB per state dir holds the trackers of every partition the sidecar owns; each
partition lives under its own key prefix. Batches are RocksDB WriteBatches, so a seal, merge,
delete or checkpoint is atomic. With `sync=True` (the default), `sync()` waits for the disk:
the caller runs it once after the checkpoints of all partitions, before it commits their inbound
offsets (see kv.SYNCED_KINDS).

Memory is bounded on purpose: small memtables and block cache, because the point of the bucket
tracker is that resident memory does not grow with the backlog.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

import rocksdict

from sidecar.errors import StorageError
from sidecar.tracker.storage.kv import KeyValueSnapshotStorage, Op

logger = logging.getLogger(__name__)

LOCK_RETRY_INTERVAL_S = 0.2
_ROCKSDB_MARKERS = ("CURRENT", "IDENTITY")
_CREATION_FILES = ("LOCK", "LOG", "rocksdict-config.json")
"""What a store's creation writes before its CURRENT file (with `*.dbtmp`, CURRENT not yet renamed
into place, and MANIFEST-/OPTIONS- files): no data. A sidecar killed there left only these, and
every later start refused the state dir (the CI run at d19a240); RocksDB creates over them."""


def _creation_cut_short(names: list[str]) -> bool:
    return all(
        name in _CREATION_FILES or name.endswith(".dbtmp") or name.startswith(("LOG.old.", "MANIFEST-", "OPTIONS-"))
        for name in names
    )


class RocksDbSnapshotStorage(KeyValueSnapshotStorage):
    """Open (or create) the tracker store of a state dir.

    Opening waits up to `lock_timeout_s` for another process (typically the previous sidecar,
    still shutting down) to release the RocksDB lock, then fails with a StorageError that says so.
    `owner`, when given, is stored on creation and checked on every open, so that two sidecars
    (or two clusters) pointed at one state dir fail loudly instead of mixing their indexes.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        owner: str | None = None,
        lock_timeout_s: float = 10.0,
        sync: bool = True,
        write_buffer_bytes: int = 4 << 20,
        block_cache_bytes: int = 4 << 20,
    ) -> None:
        self.path = Path(path)
        self.location = f"state dir {self.path}"
        self._check_dir()
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_write_buffer_size(write_buffer_bytes)
        options.set_max_write_buffer_number(2)
        options.set_compression_type(rocksdict.DBCompressionType.lz4())
        options.set_keep_log_file_num(5)
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(rocksdict.Cache(block_cache_bytes))
        # A keyed topic's intake reads each record's key, often one not there: filters answer
        # without reading a block, for 10 bits a key in the files and 2% of each memtable (82 KB).
        # 1M keys, batches of 1,000: a missing key 0.23 us against 0.68, one there 2.2 against
        # 6.6 (docs/benchmarks.md).
        table.set_bloom_filter(10, False)
        options.set_memtable_prefix_bloom_ratio(0.02)
        options.set_memtable_whole_key_filtering(True)
        options.set_block_based_table_factory(table)
        self._syncs = sync
        self._write_options = rocksdict.WriteOptions()
        self._write_options.sync = sync
        self._unsynced_options = rocksdict.WriteOptions()
        self._unsynced_options.sync = False
        self._unlogged_options = rocksdict.WriteOptions()
        self._unlogged_options.disable_wal = True  # type: ignore[method-assign,assignment]  # a property; the stub says method
        self._db = self._open(options, lock_timeout_s)
        try:
            self._check_marker(owner)
        except BaseException:
            self._db.close()
            raise

    def _check_dir(self) -> None:
        """Refuse a directory that holds files but no RocksDB, rather than mixing a DB into it (the
        files of a creation cut short by a kill are not refused: they hold nothing)."""
        if self.path.exists() and not self.path.is_dir():
            raise StorageError(f"{self.location} is a file, not a directory: point the state dir elsewhere.")
        names = [entry.name for entry in self.path.iterdir()] if self.path.is_dir() else []
        if names and not any(name in _ROCKSDB_MARKERS for name in names) and not _creation_cut_short(names):
            raise StorageError(
                f"{self.location} is not empty and holds no RocksDB (no CURRENT file): it is not a "
                "tracker state dir. Point the state dir at an empty or dedicated directory, or move "
                "the files away."
            )

    def _open(self, options: rocksdict.Options, lock_timeout_s: float) -> rocksdict.Rdict:
        deadline = time.monotonic() + lock_timeout_s
        while True:
            try:
                return rocksdict.Rdict(str(self.path), options)
            except Exception as exc:
                message = str(exc)
                if "lock" not in message.lower():
                    raise StorageError(
                        f"cannot open the RocksDB in {self.location} ({message}): it is corrupt or not "
                        "a RocksDB. Stop the sidecar, move the state dir aside (keep it for a bug "
                        "report) and restart: the tracker then rebuilds from the committed Kafka offsets."
                    ) from exc
                if time.monotonic() >= deadline:
                    raise StorageError(
                        f"the RocksDB in {self.location} is still locked after {lock_timeout_s:.0f} s "
                        f"({message}): another sidecar process uses this state dir. Stop it, or give "
                        "this instance its own state dir."
                    ) from exc
                logger.info("state dir locked, retrying path=%s", self.path)
                time.sleep(LOCK_RETRY_INTERVAL_S)

    def _get(self, key: bytes) -> bytes | None:
        try:
            value: bytes | None = self._db.get(key)
        except Exception as exc:
            raise self._io_error("read", exc) from exc
        return value

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        try:
            found = self._db.get(cast(list[str | int | float | bytes | bool], keys))  # one multi-get
            values: list[bytes | None] = list(found) if found is not None else [None] * len(keys)
        except Exception as exc:
            raise self._io_error("read", exc) from exc
        return values

    def _scan(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        try:
            # Scans read segments once, to merge and then delete them, or the log once at
            # recovery: caching their blocks would only hold memory (the bucket tracker's point).
            # Point reads of single segments still fill the cache: a block holds the bucket's
            # next segments too.
            read_options = rocksdict.ReadOptions()
            read_options.fill_cache(False)  # type: ignore[call-arg]  # the stub omits the flag
            read_options.set_iterate_upper_bound(end)
            it = self._db.iter(read_options)
            it.seek(start)
            while it.valid():  # the upper bound ends the scan at `end`
                yield it.key(), it.value()
                it.next()
        except StorageError:
            raise
        except Exception as exc:
            raise self._io_error("read", exc) from exc

    def _put_unlogged(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        put = batch.put
        for key, value in items:
            put(key, value)
        try:
            self._db.write(batch, self._unlogged_options)
        except Exception as exc:
            raise self._io_error("write", exc) from exc

    def _commit(self, ops: list[Op], sync: bool = True) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        for kind, key, value in ops:
            if kind == "put":
                batch.put(key, value)
            elif kind == "del":
                batch.delete(key)
            else:
                batch.delete_range(key, value)
        try:
            self._db.write(batch, self._write_options if sync else self._unsynced_options)
        except Exception as exc:
            raise self._io_error("write", exc) from exc

    def sync(self) -> None:
        """fsync the write-ahead log. RocksDB lets writes go on meanwhile, and the call releases
        the GIL, so the checkpoint runs it beside the loop (a synced write would hold up the
        writes queued behind it)."""
        if not self._syncs:
            return
        try:
            self._db.flush_wal(True)
        except Exception as exc:
            raise self._io_error("sync", exc) from exc

    def _io_error(self, what: str, exc: Exception) -> StorageError:
        return StorageError(
            f"RocksDB {what} failed in {self.location} ({exc}). Check free disk space, permissions and "
            "the disk itself; the tracker keeps its indexes in memory and retries."
        )

    def memory(self) -> dict[str, int]:
        """RocksDB's own count of the memory it holds, in bytes (for benchmarks)."""
        names = {"memtables": "cur-size-all-mem-tables", "block_cache": "block-cache-usage"}
        names["table_readers"] = "estimate-table-readers-mem"  # filters and indexes of the files
        return {name: int(self._db.property_int_value(f"rocksdb.{prop}") or 0) for name, prop in names.items()}

    def background_jobs(self) -> int:
        """Flushes and compactions running now: a benchmark reads memory once there are none, since
        a compaction under way holds buffers that come and go with its timing, not with the data."""
        props = ("num-running-compactions", "num-running-flushes")
        return sum(int(self._db.property_int_value(f"rocksdb.{prop}") or 0) for prop in props)

    def flush(self) -> None:
        """Flush memtables to SST files (benchmarks use it to measure a cold reopen)."""
        self._db.flush()

    def close(self) -> None:
        try:
            self._db.close()
        except Exception as exc:
            raise self._io_error("close", exc) from exc
