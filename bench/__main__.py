"""`python -m bench`: the end-to-end benchmark (bench/run.py); `python -m bench NAME ...` runs the
bench registered under NAME instead (BENCHES), with the arguments after it."""

import sys
from collections.abc import Callable

from bench.run import main


def _failover(argv: list[str]) -> int:
    from bench.failover import main as failover  # noqa: PLC0415 - only this bench needs its imports

    return failover(argv)


BENCHES: dict[str, Callable[[list[str]], int]] = {"failover": _failover}
"""Benches with a name of their own; each takes its arguments. The others run as `python -m bench.<module>`."""

if len(sys.argv) > 1 and sys.argv[1] in BENCHES:
    sys.exit(BENCHES[sys.argv[1]](sys.argv[2:]))
sys.exit(main())
