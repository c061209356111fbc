"""Child processes that die with their parent: a kill -9 of the parent must not leave them running.

A child that outlives its parent is re-parented to init and keeps its port, its data dir and its
consumer-group membership, and the next start finds it there. Linux's parent-death signal
(prctl PR_SET_PDEATHSIG) makes the kernel signal the child when its parent goes, however it goes.
Everything that starts a long-lived child (the embedded broker, the bench, the tests) passes
`preexec_fn=die_with_parent()` to subprocess.Popen.

Two properties of the parent-death signal to keep in mind:
- it fires when the *thread* that started the child ends, not only the process: start a child from
  a thread that lives at least as long as the child should (the main thread, or the thread that
  also stops it);
- it survives exec, so it reaches the real program, not only a wrapper.

preexec_fn is unsafe with threads in general (ruff's PLW1509): code in the child between fork and
exec may wait for a lock that another thread of the parent held at the fork. `arm` takes none:
prctl is looked up before the fork, and it makes three system calls.
"""

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent: the child between fork and exec must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    function: Callable[..., int] = libc.prctl
    return function


_PRCTL = _prctl()


def parent_death_supported() -> bool:
    return _PRCTL is not None


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn that has the kernel send `signum` to the child when this process dies.

    SIGTERM, not SIGKILL, by default: a broker that is told to stop saves its data first. Returns
    None where there is no prctl (not Linux); the child then stops only when it is stopped.
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        # Runs in the child between fork and exec: no allocation-heavy work, no logging.
        if prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            os._exit(125)
        if os.getppid() != parent:
            # The parent died between fork and prctl: nobody will send the signal any more.
            os._exit(125)

    return arm
