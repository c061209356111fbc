"""At-least-once offset commits that the loop waits for only so long.

librdkafka's synchronous commit has no timeout of its own: while no group coordinator is known (the
brokers away), it waits for one. On the loop's thread that blocked everything for as long as the
outage lasted: lost partitions were not handled, nothing was logged, and a SIGTERM could not stop
the process, since a Python signal handler runs only once the call returns (seen in CI: no line
for 120 s after a broker stopped). The commit runs on a thread of its own instead, waited for up to
`timeout_s`. One that has not returned by then is left to finish by itself, and no other commit is
asked for meanwhile, so commits stay in order; the caller puts its checkpoint off.
"""

import threading
from collections.abc import Callable

from sidecar.errors import BrokerError


class CommitStillWaiting(BrokerError):
    """The previous commit has not returned: the group's coordinator is away."""


class BoundedCommit:
    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._running: threading.Thread | None = None
        self._error: BaseException | None = None

    def __call__(self, commit: Callable[[], object]) -> None:
        """Run `commit`; raises what it raised, or CommitStillWaiting past the timeout."""
        if self._running is not None and self._running.is_alive():
            raise CommitStillWaiting("an earlier commit still waits for the group coordinator")
        self._error = None
        done = threading.Event()

        def run() -> None:
            try:
                commit()
            except BaseException as e:  # handed to the caller
                self._error = e
            finally:
                done.set()

        # A daemon: one still waiting for a coordinator must not hold the process at exit.
        self._running = threading.Thread(target=run, name="offset-commit", daemon=True)
        self._running.start()
        if not done.wait(self._timeout_s):
            raise CommitStillWaiting(f"the commit got no answer in {self._timeout_s:.0f} s")
        self._running = None
        if self._error is not None:
            raise self._error
