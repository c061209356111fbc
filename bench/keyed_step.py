"""What the keyed step (`by_key: replace`) spends a record on, and how much of it is RocksDB's.

Usage: .venv/bin/python -m bench.keyed_step [--keys 600000] [--runs 3]

The keyed step of intake (partitions/keyed.py: `KeyedPartition.take_many`) over a RocksDB store
opened as the sidecar opens it, fed distinct keys in slices of the engine's size, as the end-to-end
bench's keyed scenario feeds it: each key is read from the index (missing) and written to it. The
timed calls of the store are reported beside the whole step; the rest is the rule's Python. A
second table times the store's calls alone on the same keys, in the slice's order and sorted first
(as the step makes them since `7464a67`): RocksDB's part is cheaper in key order, by more than the
sort costs. No broker; the machine is shared, so compare the runs of one invocation.
"""

from __future__ import annotations

import argparse
import random
import struct
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import rocksdict

from bench.bench_tracker import BASE_MS, PARTITION, open_tracker
from sidecar.clock import ManualClock
from sidecar.engine import INTAKE_SLICE as SLICE
from sidecar.partitions.keyed import KeyedPartition
from sidecar.tracker.storage.kv import KEY_TAG, partition_prefix
from sidecar.tracker.storage.rocksdb import RocksDbSnapshotStorage


@contextmanager
def timing(cls: type, name: str, spent: dict[str, float]) -> Iterator[None]:
    """`cls.name` timed into spent[name] while the block runs."""
    original: Callable[..., Any] = getattr(cls, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - began

    setattr(cls, name, timed)
    try:
        yield
    finally:
        setattr(cls, name, original)


def keys_and_times(count: int, seed: int) -> tuple[list[bytes], list[int]]:
    rng = random.Random(seed)
    keys = [b"user-%08d" % i for i in range(count)]
    rng.shuffle(keys)
    return keys, [BASE_MS + 1_000 + rng.randrange(10**8) for _ in range(count)]


def step(count: int, seed: int) -> dict[str, float]:
    """Microseconds a record: the whole step, and the store's multi-get and unlogged write in it."""
    keys, deliver_at = keys_and_times(count, seed)
    spent: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as work:
        tracker, storage = open_tracker("bucket", Path(work), ManualClock(BASE_MS))
        keyed = KeyedPartition(tracker.key_index())
        with timing(RocksDbSnapshotStorage, "_get_many", spent), timing(RocksDbSnapshotStorage, "_put_unlogged", spent):
            for lo in range(0, count, SLICE):
                offsets = list(range(lo, lo + SLICE))
                stamps, tombstones = [BASE_MS] * len(offsets), [False] * len(offsets)
                began = time.perf_counter()
                keyed.take_many(offsets, stamps, keys[lo : lo + SLICE], tombstones, deliver_at[lo : lo + SLICE])
                spent["step"] += time.perf_counter() - began
        tracker.close()
        storage.close()
    return {name: seconds / count * 1e6 for name, seconds in spent.items()}


ENTRY = struct.Struct(">qq")


def calls(count: int, seed: int, sort: bool) -> dict[str, float]:
    """Microseconds a key of the store's calls alone: a multi-get, the batch built, its write."""
    keys, _ = keys_and_times(count, seed)
    prefix = partition_prefix(PARTITION) + KEY_TAG  # as the key index stores them
    prefixed = [prefix + key for key in keys]
    spent: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as work:
        storage = RocksDbSnapshotStorage(Path(work))
        db, unlogged = storage._db, storage._unlogged_options  # as `_put_unlogged` writes
        for lo in range(0, count, SLICE):
            began = time.perf_counter()
            part = sorted(prefixed[lo : lo + SLICE]) if sort else prefixed[lo : lo + SLICE]
            sorted_at = time.perf_counter()
            storage._get_many(part)
            read_at = time.perf_counter()
            batch = rocksdict.WriteBatch(raw_mode=True)
            for key in part:
                batch.put(key, ENTRY.pack(lo, lo))
            built_at = time.perf_counter()
            db.write(batch, unlogged)
            spent["sort"] += sorted_at - began
            spent["get"] += read_at - sorted_at
            spent["batch"] += built_at - read_at
            spent["write"] += time.perf_counter() - built_at
        storage.close()
    return {name: seconds / count * 1e6 for name, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.keyed_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=600_000, metavar="N", help="distinct keys, one record each")
    parser.add_argument("--runs", type=int, default=3, metavar="N", help="runs of each measurement, by turns")
    args = parser.parse_args()
    steps = [step(args.keys, seed) for seed in range(args.runs)]
    print(f"keyed step, {args.keys:,} distinct keys in slices of {SLICE:,} (µs a record)\n")
    print("| run | whole step | multi-get | unlogged write (batch built and written) | the rest |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for run, s in enumerate(steps, 1):
        rest = s["step"] - s["_get_many"] - s["_put_unlogged"]
        print(f"| {run} | {s['step']:.2f} | {s['_get_many']:.2f} | {s['_put_unlogged']:.2f} | {rest:.2f} |")
    print("\nthe store's calls alone, the same keys (µs a key)\n")
    print("| run | keys | sort | multi-get | batch built | write | calls in all |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for run in range(1, args.runs + 1):
        for sort in (False, True):
            c = calls(args.keys, run, sort)
            total = c["sort"] + c["get"] + c["batch"] + c["write"]
            print(
                f"| {run} | {'sorted' if sort else 'as given'} | {c['sort']:.2f} | {c['get']:.2f} | {c['batch']:.2f} "
                f"| {c['write']:.2f} | {total:.2f} |"
            )


if __name__ == "__main__":
    main()
