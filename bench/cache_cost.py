"""The payload cache's cost per record at intake and when read back, without a broker.

Usage: .venv/bin/python -m bench.cache_cost [--records 300000] [--partitions 1] [--spread-s 60]
       [--slice 2000] [--rounds 3]

Intake hands the cache one slice of a partition's delayed records at a time (`CacheBatch.add_many`)
and writes the batch once (`CacheBatch.write`): grouping costs per record, while the key, marshal,
budget and RocksDB insert cost per entry, and an entry holds the records of one slice due in one
slot (SLOT_MS). So the spread of deliver-at over the slots decides the records per entry, and with
it most of the cost. The read back is `PayloadCache.read` of every record, due-time order, as the
read-ahead asks. Records are 100-byte values with one `deliver-at` header, as in `python -m bench`.
Python's collector runs as in the sidecar (sidecar/collector.py): without it, full passes over
the records held would be most of the read back. The machine is shared: compare the best rounds of
runs made one after the other. Inside the sidecar the same steps cost 1.6 to 2.3 times as much
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Message

from sidecar.collector import Collector
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker.base import Due

TOPIC = "orders"
NOW_MS = 1_795_680_000_000


@dataclass
class Round:
    add_us: float
    """Grouping, per record (`add_many`)."""
    write_us: float
    """Serialising and writing, per record (`write`)."""
    read_us: float
    """Read back in due order, per record."""
    per_entry: float
    """Records per RocksDB entry."""


def records(count: int, partitions: int, spread_s: int, seed: int = 1) -> dict[int, list[tuple[int, int, Message]]]:
    """(offset, deliver-at, record) per partition, deliver-at uniform over `spread_s` from 1 s ahead."""
    rng = random.Random(seed)
    out: dict[int, list[tuple[int, int, Message]]] = {p: [] for p in range(partitions)}
    for i in range(count):
        partition = i % partitions
        offset = len(out[partition])
        at = NOW_MS + 1000 + rng.randrange(spread_s * 1000)
        record = Message(TOPIC, partition, offset, None, b"x" * 100, [("deliver-at", b"%d" % at)], None, (1, NOW_MS))
        out[partition].append((offset, at, record))
    return out


def measure(data: dict[int, list[tuple[int, int, Message]]], slice_size: int) -> Round:
    count = sum(len(rs) for rs in data.values())
    longest = max(len(rs) for rs in data.values())
    with tempfile.TemporaryDirectory() as work:
        cache = PayloadCache.open(Path(work) / "cache", owner="bench", budget_bytes=1 << 40, horizon_ms=1 << 40)
        assert cache is not None
        added = written = 0.0
        entries = 0
        for start in range(0, longest, slice_size):
            batch = cache.batch(NOW_MS)
            began = time.perf_counter()
            for partition, rs in data.items():
                batch.add_many(TOPIC, partition, rs[start : start + slice_size])
            grouped = time.perf_counter()
            entries += batch.entries
            batch.write()
            added += grouped - began
            written += time.perf_counter() - grouped
        wanted: dict[TopicPartitionKey, list[Due]] = {
            (TOPIC, p): sorted(Due(at, offset) for offset, at, _ in rs) for p, rs in data.items()
        }
        began = time.perf_counter()
        found = sum(len(piece) for _, piece in cache.read(wanted).chunks())
        read = time.perf_counter() - began
        cache.close()
    if found != count:
        raise RuntimeError(f"read back {found} of {count} records: the cache lost some")
    return Round(added / count * 1e6, written / count * 1e6, read / count * 1e6, count / entries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=300_000, metavar="N")
    parser.add_argument("--partitions", type=int, default=1, metavar="N")
    parser.add_argument("--spread-s", type=int, default=60, metavar="S", help="deliver-at uniform over S seconds")
    parser.add_argument("--slice", type=int, default=2_000, metavar="N", help="records per partition per write")
    parser.add_argument("--rounds", type=int, default=3, metavar="N")
    args = parser.parse_args(argv)
    data = records(args.records, args.partitions, args.spread_s)
    with Collector():  # the sidecar's collector settings: no automatic full passes over what is held
        rounds = [measure(data, args.slice) for _ in range(args.rounds)]
    best = min(rounds, key=lambda r: r.add_us + r.write_us)
    fastest_read = min(r.read_us for r in rounds)
    print(
        "| records | partitions | spread (s) | records per entry | grouping (µs/record) | writing (µs/record) "
        "| read back (µs/record) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {args.records:,} | {args.partitions} | {args.spread_s} | {best.per_entry:.1f} | {best.add_us:.2f} "
        f"| {best.write_us:.2f} | {fastest_read:.2f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
