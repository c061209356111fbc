"""A stop asked for while the sidecar is still starting.

Importing the sidecar's libraries takes about a second, before any handler of its own is in place.
A SIGTERM in that second (an orchestrator that stops a pod it has just started, a rollout that
overtakes itself) would end the process by the signal's default action: exit 143, which reads as a
crash. Nothing has been done yet at that point, so the stop is as clean as any: `install` runs first,
with no import of weight, and keeps the signal; `take` gives the defaults back and says whether one
came, and the command then exits 0 without starting.
"""

import signal
from types import FrameType

_received: list[int] = []


def _keep(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)


def install() -> None:
    signal.signal(signal.SIGTERM, _keep)
    signal.signal(signal.SIGINT, _keep)


def take() -> str | None:
    """SIGTERM and Ctrl-C back to their usual handling; the name of the signal kept, if one came."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return signal.Signals(_received[0]).name if _received else None
