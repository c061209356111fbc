"""The sidecar's own work in a burst's drain, without Kafka: popping, payload-cache reads, bookkeeping.

Usage: .venv/bin/python -m bench.due_work [--entries 500000] [--partitions 3] [--profile]

`--entries` records fall due within one second over `--partitions` bucket trackers (sealed buckets
in RocksDB, as the sidecar makes them at intake), with their payloads in a payload cache. The
dispatcher then runs turns until every entry is handed to a delivery callback that only counts. The
drain's wall time in the end-to-end bench (`python -m bench --scenarios relay-2,burst`) is this plus
producing each record to each subscription, on a machine that the broker shares; this isolates the
part that is the sidecar's own. Prints one table row; `--profile` adds cProfile's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Message

from sidecar.clock import ManualClock
from sidecar.dispatch.dispatcher import Dispatcher
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.storage import RocksDbSnapshotStorage

VALUE = b"x" * 100
HEADERS = [("deliver-at", b"1795680000000")]
INTAKE_BATCH = 500


class NoLog:
    """Every payload is in the cache; a read-back from the log would find nothing."""

    def read(self, wanted: dict[TopicPartitionKey, list[int]]) -> Any:
        for partition, offsets in wanted.items():
            for offset in offsets:
                yield partition, offset, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=500_000, metavar="N")
    parser.add_argument("--partitions", type=int, default=3, metavar="N")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="due-work-"))
    try:
        run(work, args.entries, args.partitions, args.profile)
    finally:
        shutil.rmtree(work)


def run(work: Path, entries: int, partitions: int, profile: bool) -> None:
    clock = ManualClock(1_000_000)
    storage = RocksDbSnapshotStorage(work / "state")
    cache = PayloadCache.open(work / "cache", owner="bench", budget_bytes=1 << 34, horizon_ms=3_600_000)
    assert cache is not None
    keys = [("burst", p) for p in range(partitions)]
    trackers = {key: BucketTracker(clock, storage, f"{key[0]}-{key[1]}") for key in keys}
    due_at = clock.now_ms() + 20_000
    rng = random.Random(1)
    per = entries // partitions
    for key in keys:
        offset = 0
        while offset < per:
            batch = cache.batch(clock.now_ms())
            for _ in range(min(INTAKE_BATCH, per - offset)):
                at = due_at + rng.randrange(1000)
                trackers[key].add(offset, at)
                record = Message(key[0], key[1], offset, None, VALUE, HEADERS, None, (1, 5))
                batch.add(key[0], key[1], offset, at, record)
                offset += 1
            batch.write()
        trackers[key].checkpoint(offset)
    handed = 0

    def deliver(partition: TopicPartitionKey, due: list[tuple[int, int, Message | None]]) -> None:
        nonlocal handed
        handed += len(due)

    dispatcher = Dispatcher(NoLog(), NoLog(), deliver, clock, 10_000, cache)  # type: ignore[arg-type]
    clock.advance(due_at + 1000 - clock.now_ms())
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    turns = 0
    while handed < per * partitions:
        dispatcher.turn(trackers)  # type: ignore[arg-type]
        turns += 1
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - started
    print("| entries | partitions | turns | drain (s) | µs per entry |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(f"| {handed:,} | {partitions} | {turns} | {elapsed:.2f} | {elapsed / handed * 1e6:.2f} |")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    cache.close()
    storage.close()


if __name__ == "__main__":
    main()
