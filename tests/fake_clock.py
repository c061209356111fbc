"""A monotonic clock (seconds) that only moves when a test sets `now`: injected where the code
takes `clock: Callable[[], float] = time.monotonic`."""


class MonotonicClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
