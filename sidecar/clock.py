"""Time as the tracker sees it: epoch milliseconds from an injected clock.

Tracker and dispatch logic never read the wall clock directly, so tests and benchmarks can
move time by hand and check strictness (never before deliver-at) without sleeping. `Overdue`
is the other kind of time here: how long a condition has held, for giving up on a stuck client.
"""

import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that only moves when told to."""

    def __init__(self, start_ms: int = 1_000_000) -> None:
        self._now = start_ms

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        if ms < 0:
            raise ValueError("a clock does not go backwards")
        self._now += ms

    def set(self, now_ms: int) -> None:
        self._now = now_ms


class Overdue:
    """Whether a condition has held without a break for `wait_s` seconds (time.monotonic, or the
    clock given), asked once a turn: the wait a client gets before it is made again."""

    def __init__(self, wait_s: float, clock: Callable[[], float] | None = None) -> None:
        self.wait_s = wait_s
        self._clock = clock or time.monotonic
        self._since: float | None = None

    def check(self, holds: bool) -> bool:
        """`holds`: the condition now. True once it has held for `wait_s`, until `restart`."""
        if not holds:
            self._since = None
            return False
        now = self._clock()
        if self._since is None:
            self._since = now
        return now - self._since >= self.wait_s

    @property
    def held_s(self) -> float:
        """How long the condition has held so far; 0 while it does not."""
        return 0.0 if self._since is None else self._clock() - self._since

    def restart(self) -> None:
        """What was waited on was made again: it gets the whole wait, from now."""
        self._since = self._clock()
