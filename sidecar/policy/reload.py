"""Live reload of the policies: poll the files, swap in a new PolicySet, keep the old one on a bad edit.

The engine reads `watcher.current` once per batch; swapping is one attribute assignment of an
immutable PolicySet, so a batch (and every record in it) is judged by exactly one generation and no
lock is needed on the read path. Prometheus, /healthz and logging stay outside this package: they
subscribe with `add_listener` and read `generation` / `last_error`.
"""

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sidecar.errors import ConfigError
from sidecar.policy.errors import PolicyError, Problem
from sidecar.policy.loader import POLICY_SUFFIXES, load_policies
from sidecar.policy.model import PolicySet

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
"""Half a second between looks at the files: with the settle rule below an edit takes effect within
about 1.5 s, inside the 2 s promised to operators, for a few stat+read calls per second."""
SETTLE_S = 1.0
"""How long the files must stay unchanged before they are loaded. A save that truncates and then
writes leaves an empty or half-written file for a moment; it must never become a generation."""

Trigger = Literal["poll", "signal", "manual"]


@dataclass(frozen=True)
class PolicyDiff:
    """What changed between two generations, for the engine to (un)subscribe and create topics."""

    added_topics: tuple[str, ...] = ()
    removed_topics: tuple[str, ...] = ()
    changed_topics: tuple[str, ...] = ()
    """Present in both, with a different route (delay policy, dead-letter topic or subscriptions)."""
    added_subscriptions: tuple[tuple[str, str], ...] = ()
    """(topic, subscription) pairs, including every subscription of an added topic."""
    removed_subscriptions: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return any(
            (
                self.added_topics,
                self.removed_topics,
                self.changed_topics,
                self.added_subscriptions,
                self.removed_subscriptions,
            )
        )


def diff(old: PolicySet, new: PolicySet) -> PolicyDiff:
    old_topics, new_topics = set(old.topics), set(new.topics)
    old_subs = {(t, s.name) for t, r in old.topics.items() for s in r.subscriptions}
    new_subs = {(t, s.name) for t, r in new.topics.items() for s in r.subscriptions}
    return PolicyDiff(
        added_topics=tuple(sorted(new_topics - old_topics)),
        removed_topics=tuple(sorted(old_topics - new_topics)),
        changed_topics=tuple(sorted(t for t in old_topics & new_topics if old.topics[t] != new.topics[t])),
        added_subscriptions=tuple(sorted(new_subs - old_subs)),
        removed_subscriptions=tuple(sorted(old_subs - new_subs)),
    )


@dataclass(frozen=True)
class ReloadResult:
    """One reload attempt, as listeners see it (count it by `result`, log it, show it on /healthz)."""

    ok: bool
    trigger: Trigger
    generation: int
    """The generation in force after the attempt (unchanged when it failed)."""
    error: ConfigError | None = None
    diff: PolicyDiff | None = None

    @property
    def result(self) -> str:
        """The `result` label of policy_reloads_total: "ok" or "error"."""
        return "ok" if self.ok else "error"

    @property
    def problems(self) -> tuple[Problem, ...]:
        if isinstance(self.error, PolicyError):
            return self.error.problems
        return ()


Listener = Callable[[ReloadResult], None]
Fingerprint = tuple[tuple[str, str], ...]


def fingerprint(path: Path) -> Fingerprint:
    """Names and content digests of the policy files; any edit, rename, add or delete changes it.

    Content rather than mtime: two saves within the file system's timestamp granularity with the same
    size would otherwise go unnoticed, and the files are small enough to read twice a second.
    """
    try:
        if path.is_dir():
            files: Iterable[Path] = sorted(
                p for p in path.iterdir() if p.suffix in POLICY_SUFFIXES and not p.name.startswith(".")
            )
        else:
            files = [path]
        out = []
        for file in files:
            try:
                digest = hashlib.sha256(file.read_bytes()).hexdigest()
            except OSError as e:  # missing, a directory, unreadable: the load will say which
                digest = f"error:{type(e).__name__}"
            out.append((file.name, digest))
        return tuple(out)
    except OSError as e:
        return ((str(path), f"error:{type(e).__name__}"),)


class PolicyWatcher:
    """Holds the PolicySet in force and replaces it when the files change or a reload is asked for.

    Construction loads the policies and raises ConfigError when they are invalid: a sidecar must not
    start on a broken policy. After that, a broken edit never replaces a working generation; it is
    kept in `last_error` (cleared by the next good load) and sent to the listeners.

    A change is applied once the files have looked the same on two polls in a row, at least
    `settle_s` apart, so an editor that writes a file in several steps is not caught half-way. A
    reload asked for by SIGHUP waits for the same. A policy with no topics is refused unless a file
    says `allow_empty: true`, like any other invalid policy, so a save caught while the file was
    empty cannot unsubscribe every topic.
    """

    def __init__(
        self,
        path: Path,
        *,
        interval_s: float = POLL_INTERVAL_S,
        settle_s: float = SETTLE_S,
        listeners: Iterable[Listener] = (),
        generation: int = 1,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self.settle_s = settle_s
        self._listeners: list[Listener] = list(listeners)
        self._lock = threading.RLock()  # serialises reloads; readers of `current` never take it
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        seen = fingerprint(path)
        self._current: PolicySet = load_policies(path, generation, require_topics=True)
        self._applied: Fingerprint = seen  # what the last load attempt (good or bad) saw
        self._seen: Fingerprint = seen  # what the last look saw
        self._seen_since = time.monotonic()  # since when the files have looked like `_seen`
        self._signalled = False  # a SIGHUP reload waits for the files to settle
        self.last_error: ConfigError | None = None
        log.info("policies loaded path=%s generation=%d topics=%d", path, generation, len(self._current.topics))

    # ---------------------------------------------------------------- reading

    @property
    def current(self) -> PolicySet:
        """The PolicySet in force. Read it once per unit of work and use that object throughout."""
        return self._current

    def get(self) -> PolicySet:
        """`current` as a callable, for code that takes a `Callable[[], PolicySet]`."""
        return self._current

    @property
    def generation(self) -> int:
        return self._current.generation

    def add_listener(self, listener: Listener) -> None:
        """Called after every reload attempt, on the thread that made it; exceptions are logged only."""
        self._listeners.append(listener)

    # ---------------------------------------------------------------- reloading

    def poll(self) -> ReloadResult | None:
        """Look at the files once; reload when they changed and have settled. None when nothing was done."""
        seen = fingerprint(self.path)
        now = time.monotonic()
        with self._lock:
            if seen != self._seen:
                # Changed since the last look: wait for it to settle.
                self._seen, self._seen_since = seen, now
                return None
            if now - self._seen_since < self.settle_s:
                return None
            if self._signalled:
                self._signalled = False
                return self._reload(seen, "signal")
            if seen == self._applied:
                return None
            return self._reload(seen, "poll")

    def _settle_remaining_s(self) -> float:
        return max(0.0, self._seen_since + self.settle_s - time.monotonic())

    def reload_now(self, trigger: Trigger = "manual") -> ReloadResult:
        """Load the files now, changed or not (SIGHUP, an admin endpoint). A success is a new generation."""
        with self._lock:
            return self._reload(fingerprint(self.path), trigger)

    def request_reload(self) -> None:
        """Ask the polling thread to reload at once. Safe from a signal handler: it only sets an Event."""
        self._wake.set()

    def _reload(self, seen: Fingerprint, trigger: Trigger) -> ReloadResult:
        self._applied = seen
        old = self._current
        try:
            new = load_policies(self.path, old.generation + 1, require_topics=True)
        except ConfigError as e:
            self.last_error = e
            result = ReloadResult(False, trigger, old.generation, error=e)
            log.error(
                "policy reload failed path=%s trigger=%s generation_in_force=%d problems=%d error=%r",
                self.path,
                trigger,
                old.generation,
                len(result.problems) or 1,
                str(e),
            )
        else:
            changes = diff(old, new)
            self._current = new  # the swap: one assignment of an immutable object
            self.last_error = None
            result = ReloadResult(True, trigger, new.generation, diff=changes)
            log.info(
                "policies reloaded path=%s trigger=%s generation=%d added_topics=%s removed_topics=%s "
                "changed_topics=%s",
                self.path,
                trigger,
                new.generation,
                ",".join(changes.added_topics) or "-",
                ",".join(changes.removed_topics) or "-",
                ",".join(changes.changed_topics) or "-",
            )
        self._notify(result)
        return result

    def _notify(self, result: ReloadResult) -> None:
        for listener in list(self._listeners):
            try:
                listener(result)
            except Exception:  # a broken metrics hook must not stop policy reloads
                log.exception("policy reload listener failed listener=%r", listener)

    # ---------------------------------------------------------------- background thread

    def start(self) -> "PolicyWatcher":
        """Poll every `interval_s` on a daemon thread (it dies with the process; no cleanup is needed)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="policy-watcher", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> "PolicyWatcher":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            wait_s = self.interval_s
            if self._signalled:  # a SIGHUP waits only for the files to settle, not for the next poll
                wait_s = min(wait_s, self._settle_remaining_s() + 0.01)
            woken = self._wake.wait(wait_s)
            if self._stop.is_set():
                return
            try:
                if woken:
                    self._wake.clear()
                    with self._lock:
                        self._signalled = True
                self.poll()
            except Exception:  # keep watching whatever happens; the last good generation stays in force
                log.exception("policy watcher poll failed path=%s", self.path)
