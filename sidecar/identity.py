"""Who this process is to Kafka: one live process per identity, and a new transactional.id per producer.

The identity is the instance id (`--instance-id`, its variable, or one derived from the state dir).
It names the static group member when there is one, and it prefixes every transactional.id the
process uses, whether or not the member is static. Two live processes with one identity would
fence each other in turn, so the second one on a host is refused at start (`InstanceLock`).

Each producer gets a transactional.id of its own, `<group>-<identity>-<n>`, never used before
(`TransactionalIds`). Reusing one id across restarts keeps one producer id across an abort, and
the fallback broker, noida-db, then hides that producer's later commits from read_committed
readers that kept reading past the abort marker. Apache Kafka does not need new ids for this: a
read_committed reader following a partition in 4 KiB fetches saw all 250 commits of one
transactional.id across two aborts and a re-init that aborted an open transaction (noida-db: 50);
the ids stay for the fallback broker. Before the new producer writes, every id this identity used
before and did not close cleanly is opened once: that fences a zombie still holding it and ends
whatever transaction it left open, so the last stable offset moves on. Fencing a zombie that moved
to another state dir (the same --instance-id on another host) is done at assignment, from the
commit metadata (`CommitMetadata.producer`): each producer has its name committed for every
partition it is assigned, before it writes for them, even for a partition whose rebuild commits
nothing yet (`PartitionState.claim_point`). The zombie commits until its fence, so the commits
are read again after it (`Assignment._commits`). On Kafka, fencing by consumer group generation
(KIP-447) is what keeps a zombie's offsets out after a rebalance; the ids only need to be unique.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import IO

from sidecar.errors import ConfigError, StorageError

logger = logging.getLogger(__name__)

IDS_FILE = "transactional-ids.json"
LOCK_FILE = "sidecar.lock"


class InstanceLock:
    """Held for the life of the process: the state dir, and the identity on this host.

    flock locks end with the process, kill -9 included, so a crashed sidecar never blocks its restart.
    The identity's lock file, in the temp dir, is removed at a clean close: one per group and
    identity would otherwise pile up there (a test suite left ten thousand). Removing a lock file
    is safe only because a lock is taken on the file the path still names: a process that opened
    the file before it was removed finds another one there after its flock, and tries again.
    """

    def __init__(self, state_dir: Path, group_id: str, identity: str) -> None:
        self._files: list[tuple[IO[str], Path | None]] = []
        key = hashlib.sha1(f"{group_id}\n{identity}".encode()).hexdigest()[:16]
        host = Path(tempfile.gettempdir()) / f"delay-sidecar-{key}.lock"
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._take(
                state_dir / LOCK_FILE,
                f"the state dir {state_dir} is in use by another running sidecar (pid {{pid}}). Give each "
                "sidecar its own --state-dir, or stop the other one first",
            )
            self._take(
                host,
                f"another sidecar on this host already runs as instance {identity!r} in group {group_id!r} "
                "(pid {pid}): two live processes with one identity would fence each other's transactions. "
                "Give each its own --instance-id (or leave it unset: it is derived from --state-dir)",
                remove_at_close=True,
            )
        except BaseException:
            self.close()
            raise

    def _take(self, path: Path, refusal: str, remove_at_close: bool = False) -> None:
        while True:
            try:
                handle = path.open("a+")
            except OSError as e:
                raise StorageError(f"cannot open the lock file {path} ({e}); check its permissions") from e
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                handle.close()
                raise ConfigError(refusal.format(pid=holder)) from None
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(handle.fileno()).st_ino:
                break
            handle.close()  # removed (and perhaps made again) by its last holder since it was opened
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._files.append((handle, path if remove_at_close else None))

    def close(self) -> None:
        for handle, path in self._files:
            if path is not None:  # still held: nobody can take it between the removal and the close
                with contextlib.suppress(OSError):
                    path.unlink()
            with contextlib.suppress(OSError):
                handle.close()
        self._files.clear()


class TransactionalIds:
    """Hands out a fresh transactional.id per producer and remembers the ones to fence.

    `<n>` is the start time in ms, or one more than the last n when the clock is behind it, so ids
    stay unique when the state dir (and with it the list of earlier ids) is lost. The list is
    written before the new id is used: a crash at any point leaves it naming every id that may
    still hold an open transaction.
    """

    def __init__(self, prefix: str, state_dir: Path | None = None) -> None:
        self.prefix = prefix
        self._path = state_dir / IDS_FILE if state_dir is not None else None
        self._open, self._last = self._load()

    def next(self) -> tuple[str, list[str]]:
        """(the new id, the earlier ids it must fence before it writes)."""
        n = max(time.time_ns() // 1_000_000, self._last + 1)
        self._last = n
        fresh = f"{self.prefix}-{n}"
        earlier = list(self._open)
        self._open.append(fresh)
        self._save()
        return fresh, earlier

    def ended(self, ids: list[str]) -> None:
        """These ids hold no open transaction any more: fenced, or closed after a clean stop."""
        self._open = [i for i in self._open if i not in ids]
        self._save()

    def owns(self, transactional_id: str) -> bool:
        """An id of this identity (this process's or an earlier incarnation's)."""
        head, _, n = transactional_id.rpartition("-")
        return head == self.prefix and n.isdigit()

    def _load(self) -> tuple[list[str], int]:
        if self._path is None or not self._path.exists():
            return [], 0
        try:
            data = json.loads(self._path.read_text())
            return [str(i) for i in data["open"]], int(data["last"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("transactional ids file unreadable; starting a new list path=%s error=%s", self._path, e)
            return [], 0

    def _save(self) -> None:
        if self._path is None:
            return
        temporary = self._path.with_suffix(".tmp")
        try:
            with temporary.open("w") as handle:
                json.dump({"prefix": self.prefix, "last": self._last, "open": self._open}, handle)
                handle.flush()
                os.fsync(handle.fileno())
            temporary.replace(self._path)
        except OSError as e:
            raise StorageError(
                f"cannot write {self._path} ({e}): the sidecar must record its transactional ids before "
                "it writes. Check the state dir's disk space and permissions"
            ) from e
