"""When Python's cyclic garbage collector makes its full passes: when the loop is idle, not mid-delivery.

While it works, the sidecar holds hundreds of thousands of objects the collector tracks: every
payload read ahead is a `Message`, with its list of headers. CPython's automatic full collection
visits all of them, and in the delayed benchmark (1M records due over 60 s) it found nothing to
free: 86 full collections in two minutes, 6.3 s of pauses in all, the longest 297 ms, each one a
stop of the loop and so of every delivery due meanwhile.

Young collections stay automatic: they visit only objects made since the last one, so they cost
little, and they free most cycles, which die young. Full collections run only here, between two
loop turns: when nothing falls due for a while and intake is idle, at most every MIN_INTERVAL_S;
and, whatever the load, once MAX_INTERVAL_S has passed since the last one, so that cycles which
outlived two young collections are freed within that time. What is there at start (modules,
settings, the policies) is frozen out of every collection (`gc.freeze`).

The settings are the process's, so two sidecars in one process (tests) share them: the first to
start sets them and the last to stop puts back what it found.
"""

import gc
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

logger = logging.getLogger(__name__)

# A full pass when the next delivery is at least this far and the last intake batch was empty.
IDLE_S = 0.5
MIN_INTERVAL_S = 30.0
# Longest without a full pass, busy or not: bounds how long cyclic garbage is kept.
MAX_INTERVAL_S = 300.0
# Automatic full collections never come: generation 2's threshold counts generation 1 collections.
NEVER = 2**31 - 1

_lock = threading.Lock()
_users = 0
_saved: tuple[int, int, int] = gc.get_threshold()


class Collector:
    def __init__(
        self,
        observe: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`observe(reason, seconds)`: told of each full pass (reason "idle" or "due")."""
        self._observe = observe
        self._clock = clock
        self._last = clock()

    def __enter__(self) -> "Collector":
        global _users, _saved
        with _lock:
            if _users == 0:
                _saved = gc.get_threshold()
                gc.collect()
                gc.freeze()
                gc.set_threshold(_saved[0], _saved[1], NEVER)
            _users += 1
        self._last = self._clock()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        global _users
        with _lock:
            _users -= 1
            if _users == 0:
                gc.unfreeze()
                gc.set_threshold(*_saved)

    def between_turns(self, wait_s: float, idle: bool) -> None:
        """Called before the loop waits `wait_s` for records; `idle`: the last batch was empty."""
        now = self._clock()
        since = now - self._last
        if since >= MAX_INTERVAL_S:
            reason = "due"
        elif idle and wait_s >= IDLE_S and since >= MIN_INTERVAL_S:
            reason = "idle"
        else:
            return
        started = time.perf_counter()
        found = gc.collect()
        spent = time.perf_counter() - started
        self._last = self._clock()
        if self._observe is not None:
            self._observe(reason, spent)
        logger.debug("full garbage collection reason=%s ms=%.1f freed=%d", reason, spent * 1000, found)
