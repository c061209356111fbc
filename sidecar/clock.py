"""Time as the tracker sees it: epoch milliseconds from an injected clock.

Tracker and dispatch logic never read the wall clock directly, so tests and benchmarks can
move time by hand and check strictness (never before deliver-at) without sleeping.
"""

import time
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
