"""Opening the payload cache's RocksDB: whether what is on disk may be trusted, or is dropped.

The cache is only a cache (payload_cache.py), so opening it never fails the sidecar: a store
written for another cluster or group, by another version, or by a process that did not close it
cleanly is dropped and started empty; one locked by another process, or that cannot be created,
leaves the sidecar running without it. A clean close writes a mark with the byte counts, and a
start removes it (synced), so a crash in between is noticed at the next start.
"""

from __future__ import annotations

import logging
import marshal
import shutil
import time
from pathlib import Path

import rocksdict

logger = logging.getLogger(__name__)

META_OWNER = b"m/owner"
META_FORMAT = b"m/format"
META_CLEAN = b"m/clean"
"""Written last by a clean close, with the byte counts; its absence at open means a crash."""
LOCK_TIMEOUT_S = 10.0
LOCK_RETRY_INTERVAL_S = 0.2


def open_store(path: Path, owner: str, layout: bytes) -> tuple[rocksdict.Rdict, dict[int, int]] | None:
    """The store with the byte counts per second of its last clean close, or None: no cache.
    `layout`: the version of the key and value layout; a store written with another is dropped."""
    db: rocksdict.Rdict | None
    try:
        db = _open(path)
    except _Locked as exc:
        logger.error(
            "payload cache locked by another process; running without it path=%s error=%s "
            "(give each sidecar its own --state-dir)",
            path,
            exc,
        )
        return None
    except Exception as exc:  # corrupt or not a RocksDB: it is only a cache
        logger.warning("payload cache cannot be opened; dropping it path=%s error=%s", path, one_line(exc))
        db = _recreate(path, None)
    else:
        try:
            reason = _unusable(db, owner, layout)
        except Exception as exc:
            reason = f"unreadable ({one_line(exc)})"
        if reason is not None:
            logger.warning("payload cache dropped path=%s reason=%s", path, reason)
            db = _recreate(path, db)
    if db is None:
        return None
    try:
        return db, _start(db, owner, layout)
    except Exception as exc:
        logger.error("payload cache unusable; running without it path=%s error=%s", path, one_line(exc))
        close_quietly(db)
        return None


class _Locked(Exception):
    pass


def _options() -> rocksdict.Options:
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    options.set_write_buffer_size(16 << 20)
    options.set_max_write_buffer_number(2)
    options.set_compression_type(rocksdict.DBCompressionType.lz4())
    options.set_keep_log_file_num(2)
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(rocksdict.Cache(8 << 20))
    options.set_block_based_table_factory(table)
    return options


def _open(path: Path) -> rocksdict.Rdict:
    """Open, waiting a while for a previous sidecar that still holds the lock."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file")
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            return rocksdict.Rdict(str(path), _options())
        except Exception as exc:
            if "lock" not in str(exc).lower():
                raise
            if time.monotonic() >= deadline:
                raise _Locked(one_line(exc)) from exc
            time.sleep(LOCK_RETRY_INTERVAL_S)


def _unusable(db: rocksdict.Rdict, owner: str, layout: bytes) -> str | None:
    """Why an existing cache must not be used, or None. A new, empty cache is usable."""
    stored_owner = db.get(META_OWNER)
    if stored_owner is None:
        return None if _empty(db) else "no owner recorded"
    if stored_owner != owner.encode():
        return f"written for another cluster or group ({stored_owner.decode(errors='replace')})"
    if db.get(META_FORMAT) != layout:
        return "written by another version"
    if db.get(META_CLEAN) is None:
        return "the last run did not stop cleanly"
    return None


def _empty(db: rocksdict.Rdict) -> bool:
    for _ in db.keys():  # noqa: SIM118 - keys() reads no values
        return False
    return True


def _start(db: rocksdict.Rdict, owner: str, layout: bytes) -> dict[int, int]:
    """Record the owner, take the byte counts of the last clean close and remove the clean mark
    (synced), so a crash from here on is noticed at the next start."""
    clean = db.get(META_CLEAN)
    counts: dict[int, int] = marshal.loads(clean) if clean is not None else {}
    synced = rocksdict.WriteOptions()
    synced.sync = True
    batch = rocksdict.WriteBatch(raw_mode=True)
    batch.put(META_OWNER, owner.encode())
    batch.put(META_FORMAT, layout)
    batch.delete(META_CLEAN)
    db.write(batch, synced)
    return counts


def _recreate(path: Path, db: rocksdict.Rdict | None) -> rocksdict.Rdict | None:
    if db is not None:
        close_quietly(db)
    try:
        shutil.rmtree(path, ignore_errors=False) if path.is_dir() else path.unlink(missing_ok=True)
        return rocksdict.Rdict(str(path), _options())
    except Exception as exc:
        logger.error(
            "payload cache cannot be created; running without it path=%s error=%s "
            "(check the state dir's permissions and free space)",
            path,
            one_line(exc),
        )
        return None


def close_quietly(db: rocksdict.Rdict) -> None:
    try:
        db.close()
    except Exception as exc:
        logger.debug("payload cache close failed error=%s", exc)


def one_line(exc: BaseException) -> str:
    return str(exc).replace("\n", " ")
