"""How fast a keyed partition is read again after kill -9 and a lost state dir.

A partition of a `by_key: replace` topic is always read again from its earliest pending record when
its next owner starts (tracker/keys.py): its key index is not kept. So its restart, a handoff and a
lost state dir each cost one read of the pending part of the log through the keyed step, at the rate
the sidecar logs when it is done (`index rebuild done ... rate=`). This bench produces `--records`
keyed records due in an hour (one key each, one partition), lets a sidecar index them all, kills it
with SIGKILL, deletes its state dir and starts it again, `--rounds` times.

Usage: .venv/bin/python -m bench.keyed_rebuild [--records 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Producer

from bench.probe import create_topic, metric_sum, scrape
from bench.procs import bench_broker, start_sidecar
from bench.report import command_line, dated_lines
from sidecar.broker.ports import free_port

REBUILT = re.compile(r"index rebuild done.* offset=(\d+) until=(\d+) indexed=(\d+) .*rate=(\d+)/s")


def produce(bootstrap: str, topic: str, records: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "queue.buffering.max.messages": 1_000_000})
    for i in range(records):
        producer.produce(topic, b"x" * 100, key=b"user-%07d" % i, headers=[("deliver-after", "1h")])
        if i % 10_000 == 0:
            producer.poll(0)
    if producer.flush(120):
        raise SystemExit("the load was not acknowledged within 120 s")


def wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.2)


def one_round(bootstrap: str, records: int, work: Path) -> tuple[int, float]:
    """(records indexed again, rate per second as the sidecar logged it)."""
    topic = f"rebuild-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 1)
    policies = work / f"{topic}.yaml"
    policies.write_text(
        f"topics:\n  {topic}:\n    delayed_delivery: {{by_key: replace}}\n    subscriptions:\n      a: {{}}\n"
    )
    produce(bootstrap, topic, records)
    state, port = work / topic, free_port()
    sidecar = start_sidecar(bootstrap, policies, state, port, f"g-{topic}", work / f"{topic}-1.log")
    try:
        wait(lambda: metric_sum(scrape(port), "delay_sidecar_tracked_messages") >= records, 300, "every record indexed")
    finally:
        sidecar.process.kill()
        sidecar.process.wait()
    shutil.rmtree(state)
    log = work / f"{topic}-2.log"
    sidecar = start_sidecar(bootstrap, policies, state, port, f"g-{topic}", log, "--log-level", "INFO")
    try:
        wait(lambda: REBUILT.search(log.read_text()) is not None, 300, "the rebuild done")
    finally:
        sidecar.stop()
    found = REBUILT.search(log.read_text())
    assert found is not None
    return int(found[3]), float(found[4])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.keyed_rebuild", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000, metavar="N", help="keyed records pending (200000)")
    parser.add_argument("--rounds", type=int, default=3, metavar="N", help="kill -9 and rebuild this many times (3)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-keyed-rebuild-") as tmp:
        work = Path(tmp)
        broker = bench_broker(work / "broker")
        with broker:
            dated = dated_lines(broker, command_line("bench.keyed_rebuild", argv))
            rates = []
            for _ in range(args.rounds):
                read, rate = one_round(broker.bootstrap_servers, args.records, work)
                rates.append(rate)
                print(f"round {len(rates)}: {read:,} records read again at {rate:,.0f}/s", file=sys.stderr)
    print(dated)
    print()
    print("| records pending (keyed) | rebuild rate per round (records/s) | median | time to read them again |")
    print("| ---: | --- | ---: | ---: |")
    median = statistics.median(rates)
    each = ", ".join(f"{r:,.0f}" for r in rates)
    print(f"| {args.records:,} | {each} | {median:,.0f} | {args.records / median:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
