"""What one dispatch read-back costs: sidecar.dispatch.reader.LogReader.read on random due offsets.

The delayed path keeps positions only and reads due records back from the inbound log. With delays
spread at random, the records due in one dispatch turn are spread over the whole log, so a turn
reads through (or seeks across) most of it, whatever the number of due records. This measures the
cost of one read against the number of due offsets, on one partition of `--log` records, on a
broker of its own (Apache Kafka; DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback's figures) or
the one `--bootstrap` names.

Usage: .venv/bin/python -m bench.readback [--log 333000] [--due 100,1000,5000,20000,50000]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.probe import create_topic
from bench.procs import bench_broker, load_argv, run_load
from bench.report import command_line, dated_lines
from sidecar.broker import BrokerLauncher, ExternalBroker
from sidecar.dispatch.reader import DEFAULT_MAX_GAP, LogReader


def offset_ranges(offsets: list[int], max_gap: int = DEFAULT_MAX_GAP) -> list[tuple[int, int]]:
    """(first, last) stretches the reader reads through: a gap wider than max_gap starts a new one."""
    ranges: list[tuple[int, int]] = []
    for offset in offsets:
        if ranges and offset - ranges[-1][1] <= max_gap:
            ranges[-1] = (ranges[-1][0], offset)
        else:
            ranges.append((offset, offset))
    return ranges


def measure(bootstrap: str, log_records: int, due_counts: list[int], workdir: Path, repeats: int = 3) -> list[str]:
    topic = f"bench.readback-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, 1)
    run_load(load_argv(bootstrap, topic, log_records), workdir / "readback-load.log")
    reader = LogReader({"bootstrap.servers": bootstrap}, threading.Event())
    rng = random.Random(7)
    lines = [
        f"LogReader.read, one partition of {log_records:,} records (100-byte values), max_gap {DEFAULT_MAX_GAP}:",
        "",
        "| due offsets | records in read ranges | seeks | ms per read (best of 3) | due records/s |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    try:
        for due in due_counts:
            best = float("inf")
            offsets = sorted(rng.sample(range(log_records), min(due, log_records)))
            ranges = offset_ranges(offsets)
            for _ in range(repeats):
                started = time.monotonic()
                got = sum(1 for _ in reader.read({(topic, 0): offsets}))
                best = min(best, time.monotonic() - started)
                assert got == len(offsets)
            spanned = sum(last - first + 1 for first, last in ranges)
            lines.append(
                f"| {len(offsets):,} | {spanned:,} | {len(ranges) - 1:,} | {1000 * best:,.0f} "
                f"| {len(offsets) / best:,.0f} |"
            )
    finally:
        reader.close()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", type=int, default=333_000, help="records in the partition")
    parser.add_argument("--due", default="100,1000,5000,20000,50000", help="due offsets per read")
    parser.add_argument("--bootstrap", help="an existing broker instead of one of its own")
    args = parser.parse_args(argv)
    due_counts = [int(x) for x in args.due.split(",")]
    command = command_line("bench.readback", argv)
    with tempfile.TemporaryDirectory(prefix="bench-readback-") as tmp:
        workdir = Path(tmp)
        if args.bootstrap:
            broker: BrokerLauncher = ExternalBroker(args.bootstrap)
            dated = dated_lines(broker, command)
            lines = measure(args.bootstrap, args.log, due_counts, workdir)
        else:
            with bench_broker(workdir / "broker") as broker:
                dated = dated_lines(broker, command)
                lines = measure(broker.bootstrap_servers, args.log, due_counts, workdir)
    print(dated + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
