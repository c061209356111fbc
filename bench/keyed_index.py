"""Keyed topics' intake (`by_key: replace`) against a topic without keys, on the bucket tracker.

Both runs add N delayed records (offsets 0..N-1, delays uniform over 7 days) to a bucket tracker
on RocksDB, checkpointing every 100,000 as the sidecar does at each commit. The keyed run also
takes each record through the keyed step (partitions/keyed.py) with one of K keys chosen at
random, as intake does: a key index lookup and write (RocksDB, written with each checkpoint), the
clock, and the replaced set. Every record is stamped before every deliver-at, so each one replaces
its key's pending record: at the end K are pending and N - K replaced. Each run is a subprocess of
its own, so resident memory starts clean.

Reported: adds per second, and their ratio (target: keyed at least 0.8x); resident memory grown
per key and per record; the state dir on disk per key; and what RocksDB says it holds (memtables
and block cache, bounded by the store's settings whatever the keys; filters and indexes of its
files, which grow with them). In-process only: the lateness side of the
target (p99 through a broker, keyed against unkeyed) is not measured here.

Resident memory is read once RocksDB runs no flush or compaction (their buffers come and go with
their timing) and after glibc has given freed heap back (malloc_trim): read at a random moment,
the same code measured 9.7 and 19.7 B a key. A third run, keyed with twice the keys, gives what
each key more costs, which no fixed-size cache of RocksDB's is part of.

Usage: .venv/bin/python bench/keyed_index.py [--count N] [--keys K] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_tracker import BASE_MS, chunks, open_tracker, rss  # noqa: E402
from sidecar.clock import ManualClock  # noqa: E402
from sidecar.engine import INTAKE_SLICE as SLICE  # noqa: E402
from sidecar.partitions.keyed import KeyedPartition  # noqa: E402

SETTLE_S = 120.0
"""How long a run waits for RocksDB's flushes and compactions to end before it reads memory."""


def settled_rss(storage: Any) -> int:
    """Resident memory once RocksDB is idle and glibc has returned freed heap to the system."""
    deadline = time.monotonic() + SETTLE_S
    while storage.background_jobs() and time.monotonic() < deadline:
        time.sleep(0.1)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss()


def fill(keyed: bool, count: int, keys: int, state: Path, seed: int) -> dict[str, Any]:
    clock = ManualClock(BASE_MS)
    tracker, storage = open_tracker("bucket", state, clock)
    rng = random.Random(seed + 1)
    names = [b"user-%07d" % k for k in range(keys)] if keyed else []
    step = KeyedPartition(tracker.key_index()) if keyed else None
    baseline = settled_rss(storage)
    elapsed = 0.0
    for start, deliver_at in chunks(count, seed):
        chosen = [names[rng.randrange(keys)] for _ in deliver_at] if keyed else []
        began = time.perf_counter()
        add = tracker.add
        if step is None:
            for i, at in enumerate(deliver_at, start):
                add(i, at)
        else:  # as intake does: the keyed step over the slice, then each delayed record into the index
            offsets = range(start, start + len(deliver_at))
            for lo in range(0, len(deliver_at), SLICE):
                part = offsets[lo : lo + SLICE]
                ats = deliver_at[lo : lo + SLICE]
                step.take_many(part, [BASE_MS] * len(part), chosen[lo : lo + SLICE], [False] * len(part), ats)
                for i, at in zip(part, ats, strict=True):
                    add(i, at, deliver_now=False)
        tracker.checkpoint(start + len(deliver_at))
        elapsed += time.perf_counter() - began
    grown = settled_rss(storage) - baseline
    held = storage.memory()
    result: dict[str, Any] = {
        "rocksdb_mb": {name: size / 2**20 for name, size in held.items()},
        "adds_per_s": count / elapsed,
        "rss_growth_mb": grown / 2**20,
        "bytes_per_record": grown / count,
        "bytes_per_key": grown / keys,
        "replaced": len(step.replaced) if step is not None else 0,
    }
    tracker.close()
    storage.flush()
    storage.close()
    result["state_dir_mb"] = sum(f.stat().st_size for f in state.iterdir()) / 2**20
    return result


def spawn(keyed: bool, count: int, keys: int, state: Path, seed: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", "keyed" if keyed else "plain", "--count", str(count)]
    command += ["--keys", str(keys), "--state", str(state), "--seed", str(seed)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit("worker failed")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000_000)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="200,000 records over 20,000 keys, for a smoke run")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--worker", choices=["plain", "keyed"], help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(fill(args.worker == "keyed", args.count, args.keys, Path(args.state), args.seed)), flush=True)
        return
    count, keys = (200_000, 20_000) if args.quick else (args.count, args.keys)
    with tempfile.TemporaryDirectory(prefix="keyed-bench-") as work:
        plain = spawn(False, count, keys, Path(work) / "plain", args.seed)
        keyed = spawn(True, count, keys, Path(work) / "keyed", args.seed)
        doubled = spawn(True, count, 2 * keys, Path(work) / "doubled", args.seed)
    print(f"{count:,} records, {keys:,} keys (bucket tracker on RocksDB, checkpoint every 100,000)\n")
    print("| | without keys | keyed (`by_key: replace`) |")
    print("| --- | --- | --- |")
    print(f"| adds/s | {plain['adds_per_s']:,.0f} | {keyed['adds_per_s']:,.0f} "
          f"({keyed['adds_per_s'] / plain['adds_per_s']:.2f}x; target at least 0.8x) |")  # fmt: skip
    print(f"| resident memory grown | {plain['rss_growth_mb']:,.1f} MB | {keyed['rss_growth_mb']:,.1f} MB |")
    extra = (keyed["rss_growth_mb"] - plain["rss_growth_mb"]) * 2**20 / keys
    print(f"| memory for the keys, per key | | {extra:,.1f} B (target at most 16 B) |")
    more = (doubled["rss_growth_mb"] - keyed["rss_growth_mb"]) * 2**20 / keys
    print(f"| each key more ({keys:,} → {2 * keys:,} keys: {keyed['rss_growth_mb']:,.1f} → "
          f"{doubled['rss_growth_mb']:,.1f} MB) | | {more:,.1f} B |")  # fmt: skip
    print(f"| state dir | {plain['state_dir_mb']:,.1f} MB | {keyed['state_dir_mb']:,.1f} MB "
          f"({(keyed['state_dir_mb'] - plain['state_dir_mb']) * 2**20 / keys:,.1f} B more per key) |")  # fmt: skip
    print(f"| replaced at the end | | {keyed['replaced']:,} |")
    for name, size in plain["rocksdb_mb"].items():
        print(f"| RocksDB {name.replace('_', ' ')} | {size:,.1f} MB | {keyed['rocksdb_mb'][name]:,.1f} MB |")


if __name__ == "__main__":
    main()
