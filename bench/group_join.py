"""Two members joining an empty group a short gap apart: how often the broker's group wedges.

Usage: .venv/bin/python -m bench.group_join [--gaps 0.3,1.5] [--rounds 12] [--wait-s 20] [--static]

Each round creates a fresh topic of 4 partitions and a fresh group on one broker of its own (Apache
Kafka; DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback, whose wedge this measured). Two plain
confluent-kafka consumers subscribe to it from two threads, the second `gap` seconds after the
first, and poll. A round is wedged when either member has had no assignment callback (not even an
empty one) within `--wait-s`. On Kafka the group forms within its initial rebalance delay; on
noida-db 0.2.3 a JoinGroup that reaches the empty group about 0.3 s after the first one leaves both
unanswered until the rebalance timeout (`max.poll.interval.ms`, 5 minutes), which is why
`run --workers N` starts its workers in turn (sidecar/supervisor.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, TopicPartition

from bench.probe import create_topic
from bench.procs import bench_broker
from bench.report import command_line, dated_lines


def member(
    bootstrap: str, group: str, topic: str, group_member: int, instance: str | None, wait_s: float, joins: Joins
) -> None:
    """Subscribe and poll until both members had their first assignment callback (an empty assignment
    counts) or `wait_s` passed. It stays until then: a static member that closed early would never
    leave the group on noida-db, and the other would wait for it."""
    config = {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
              "session.timeout.ms": 6000, "partition.assignment.strategy": "roundrobin"}  # fmt: skip
    if instance is not None:
        config["group.instance.id"] = instance
    consumer = Consumer(config)
    start = time.monotonic()

    def on_assign(_: Consumer, __: list[TopicPartition]) -> None:
        joins.answered(group_member, time.monotonic() - start)

    consumer.subscribe([topic], on_assign=on_assign)
    try:
        while time.monotonic() - start < wait_s and not joins.both.is_set():
            consumer.poll(0.1)
    finally:
        consumer.close()


class Joins:
    """Each member's first assignment callback, in seconds from its subscribe. By member: one member
    called twice (assigned, then reassigned when the other joined) has not answered for the other."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.both = threading.Event()
        self._lock = threading.Lock()

    def answered(self, group_member: int, after_s: float) -> None:
        with self._lock:
            self.first.setdefault(group_member, after_s)
            if len(self.first) == 2:
                self.both.set()


def one_round(bootstrap: str, gap_s: float, wait_s: float, static: bool) -> Joins:
    topic = f"join-{uuid.uuid4().hex[:10]}"
    create_topic(bootstrap, topic, 4)
    joins = Joins()
    threads = [
        threading.Thread(
            target=member, args=(bootstrap, f"g-{topic}", topic, i, f"m-{i}" if static else None, wait_s, joins)
        )
        for i in range(2)
    ]
    threads[0].start()
    time.sleep(gap_s)
    threads[1].start()
    for thread in threads:
        thread.join()
    return joins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gaps", default="0.3,1.5", metavar="S,S", help="gaps between the two joins, in seconds")
    parser.add_argument("--rounds", type=int, default=12, metavar="N", help="rounds per gap")
    parser.add_argument("--wait-s", type=float, default=20.0, metavar="S", help="a round is wedged after this")
    parser.add_argument("--static", action="store_true", help="static members (group.instance.id), as workers are")
    args = parser.parse_args(argv)
    gaps = [float(g) for g in args.gaps.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as data:
        broker = bench_broker(Path(data))
        bootstrap = broker.start()
        try:
            dated = dated_lines(broker, command_line("bench.group_join", argv))
            for gap in gaps:
                joins = [one_round(bootstrap, gap, args.wait_s, args.static) for _ in range(args.rounds)]
                wedged = sum(1 for found in joins if not found.both.is_set())
                formed = sorted(max(found.first.values()) for found in joins if found.both.is_set())
                slowest = f"{formed[-1]:.2f}" if formed else "-"
                rows.append(f"| {gap:.2f} | {args.rounds} | {wedged} | {slowest} |")
        finally:
            broker.stop()
    print(dated + "\n")
    print(f"| gap (s) | rounds | wedged (no answer within {args.wait_s:.0f} s) | slowest first answer (s) |")
    print("| ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
