"""Bucket tracker (RocksDB) against the in-memory tracker, on N delayed messages over 7 days.

Each measurement runs in its own subprocess, so resident memory starts clean and a "restart" is a
real new process:

* fill: add N messages (offsets 0..N-1, delays uniform over 7 days) and report adds/s and RSS
  growth per tracked message. The bucket tracker checkpoints every 100,000 adds, as the sidecar
  would at each offset commit.
* restart: a new process, an hour (of tracker clock) after the adds, from its start to its first
  delivery in deliver-at order. The bucket tracker reopens its state dir; the in-memory tracker
  must see every message again before it knows which is due first, simulated by re-adding them
  (cheaper than reading them back from Kafka, so its number flatters it). Then the clock jumps a
  day ahead and the burst that fell due is popped: pops/s.

Usage: .venv/bin/python bench/bench_tracker.py [--count N] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from sidecar.clock import ManualClock  # noqa: E402
from sidecar.tracker.base import DelayedDeliveryTracker  # noqa: E402
from sidecar.tracker.bucket import BucketTracker  # noqa: E402
from sidecar.tracker.memory import InMemoryTracker  # noqa: E402
from sidecar.tracker.storage import RocksDbSnapshotStorage  # noqa: E402

BASE_MS = 1_700_000_000_000
WEEK_MS = 7 * 86_400_000
CHUNK = 100_000
CHECKPOINT_EVERY = 100_000
PARTITION = "bench.orders/0"

TARGET_BYTES_PER_MSG = 4.0
TARGET_FIRST_DELIVERY_S = 2.0
TARGET_ADDS_PER_S = 200_000


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def chunks(count: int, seed: int) -> Any:
    """Deliver-at times in chunks, generated outside the timed add loop."""
    rng = random.Random(seed)
    for start in range(0, count, CHUNK):
        n = min(CHUNK, count - start)
        yield start, array("q", [BASE_MS + 1 + int(rng.random() * WEEK_MS) for _ in range(n)])


def open_tracker(kind: str, state: Path, clock: ManualClock) -> tuple[DelayedDeliveryTracker, Any]:
    if kind == "memory":
        return InMemoryTracker(clock), None
    storage = RocksDbSnapshotStorage(state)
    return BucketTracker(clock, storage, PARTITION), storage


class SealLog(logging.Handler):
    """Collects the seal and merge timings the tracker logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seal_ms: list[float] = []
        self.merge_ms: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.args, tuple) or not record.args:
            return
        milliseconds = float(str(record.args[-1]))
        if record.msg.startswith("bucket sealed"):
            self.seal_ms.append(milliseconds)
        elif record.msg.startswith("buckets merged"):
            self.merge_ms.append(milliseconds)


def fill(kind: str, count: int, state: Path, seed: int) -> dict[str, Any]:
    log = SealLog()
    logging.getLogger("sidecar.tracker.bucket.tracker").addHandler(log)
    logging.getLogger("sidecar.tracker.bucket.tracker").setLevel(logging.INFO)
    clock = ManualClock(BASE_MS)
    tracker, storage = open_tracker(kind, state, clock)
    baseline = rss()
    elapsed = 0.0
    for start, deliver_at in chunks(count, seed):
        began = time.perf_counter()
        add = tracker.add
        for i, at in enumerate(deliver_at, start):
            add(i, at)
        if storage is not None:
            tracker.checkpoint(start + len(deliver_at))
        elapsed += time.perf_counter() - began
    del deliver_at
    grown = rss() - baseline
    result: dict[str, Any] = {
        "adds_per_s": count / elapsed,
        "bytes_per_msg": grown / count,
        "rss_growth_mb": grown / 2**20,
        "tracked": len(tracker),
    }
    if storage is not None:
        stats = tracker.stats()  # type: ignore[attr-defined]
        result.update(
            buckets=stats.buckets,
            snapshot_mb=stats.snapshot_bytes / 2**20,
            seals=len(log.seal_ms),
            seal_ms_median=sorted(log.seal_ms)[len(log.seal_ms) // 2] if log.seal_ms else 0.0,
            seal_ms_max=max(log.seal_ms, default=0.0),
            merges=len(log.merge_ms),
            merge_s_total=sum(log.merge_ms) / 1000,
        )
        tracker.close()
        storage.flush()
        storage.close()
        result["state_dir_mb"] = sum(f.stat().st_size for f in state.iterdir()) / 2**20
    return result


def restart(kind: str, count: int, state: Path, seed: int, started: float) -> dict[str, Any]:
    """Runs in a fresh process; `started` is the wall time the parent spawned it."""
    clock = ManualClock(BASE_MS)
    tracker, storage = open_tracker(kind, state, clock)
    if storage is None:
        # The replay a non-durable tracker needs before it knows which message is due first.
        for start, deliver_at in chunks(count, seed):
            add = tracker.add
            for i, at in enumerate(deliver_at, start):
                add(i, at)
    clock.set(BASE_MS + 3_600_000)  # the restart came an hour after the adds: some fell due
    first = tracker.pop_due(1)
    first_delivery_s = time.time() - started
    assert first, "nothing due after the restart"
    clock.set(BASE_MS + 86_400_000)  # a day's worth of messages falls due at once
    popped, began = 1, time.perf_counter()
    while batch := tracker.pop_due(10_000):
        popped += len(batch)
    pop_s = time.perf_counter() - began
    result = {"first_delivery_s": first_delivery_s, "burst": popped, "pops_per_s": popped / pop_s}
    if storage is not None:
        tracker.close()
        storage.close()
    return result


def run_worker(args: argparse.Namespace) -> None:
    state = Path(args.state)
    if args.phase == "fill":
        out = fill(args.kind, args.count, state, args.seed)
    else:
        out = restart(args.kind, args.count, state, args.seed, args.started)
    print(json.dumps(out), flush=True)


def spawn(phase: str, kind: str, count: int, state: Path, seed: int) -> dict[str, Any]:
    started = time.time()
    command = [sys.executable, __file__, "--worker", phase, "--kind", kind, "--count", str(count)]
    command += ["--state", str(state), "--seed", str(seed), "--started", repr(started)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{phase} worker for {kind} failed")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000_000)
    parser.add_argument("--quick", action="store_true", help="200,000 messages, for a smoke run")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--worker", choices=["fill", "restart"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=["bucket", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.phase = args.worker
        run_worker(args)
        return
    count = 200_000 if args.quick else args.count
    workdir = Path(tempfile.mkdtemp(prefix="bench-tracker-"))
    try:
        results: dict[str, dict[str, Any]] = {}
        for kind in ("bucket", "memory"):
            state = workdir / kind
            results[kind] = spawn("fill", kind, count, state, args.seed)
            results[kind].update(spawn("restart", kind, count, state, args.seed))
            print(f"{kind}: {json.dumps(results[kind])}", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    b, m = results["bucket"], results["memory"]
    print(f"\n{count:,} delayed messages, delays uniform over 7 days, Python {sys.version.split()[0]}, ", end="")
    print(f"{os.cpu_count()} CPUs\n")
    print("| metric | bucket tracker (RocksDB) | in-memory tracker | target |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| adds/s | {fmt(b['adds_per_s'])} | {fmt(m['adds_per_s'])} | ≥ {TARGET_ADDS_PER_S:,} |")
    print(f"| RSS per tracked message | {fmt(b['bytes_per_msg'], 2)} B | {fmt(m['bytes_per_msg'], 2)} B ", end="")
    print(f"| ≤ {TARGET_BYTES_PER_MSG:g} B |")
    print(f"| RSS growth | {fmt(b['rss_growth_mb'], 1)} MiB | {fmt(m['rss_growth_mb'], 1)} MiB | |")
    print(f"| process start to first delivery after restart | {fmt(b['first_delivery_s'], 2)} s ", end="")
    print(f"| {fmt(m['first_delivery_s'], 2)} s | ≤ {TARGET_FIRST_DELIVERY_S:g} s |")
    print(f"| pops/s, burst of {b['burst']:,} due at once | {fmt(b['pops_per_s'])} | {fmt(m['pops_per_s'])} | |")
    print(f"| seals: count, median / max ms | {b['seals']:,}, {fmt(b['seal_ms_median'], 1)} / ", end="")
    print(f"{fmt(b['seal_ms_max'], 1)} ms | n/a | Pulsar #24603: 1,500 ms |")
    print(f"| merges: count, total s | {b['merges']:,}, {fmt(b['merge_s_total'], 1)} s | n/a | |")
    print(f"| buckets at the end | {b['buckets']} | n/a | ≤ 50 |")
    print(f"| state dir on disk | {fmt(b['state_dir_mb'], 1)} MiB | n/a | |")


if __name__ == "__main__":
    main()
