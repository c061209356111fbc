"""The sidecar's cost of sending one delivered record to its subscriptions, without a broker.

Usage: .venv/bin/python -m bench.send_cost [--records 10000] [--rounds 40] [--subscriptions 2]

`Delivery.send_many` builds each record's outbound headers (the compact form) and produces it to
each subscription's topic. The producer here points at a closed port, so `produce()` only queues
(each round's queue is purged after it): what is timed is the sidecar's Python plus
confluent-kafka's conversion of each record, the part of a delivery that is the sidecar's own
process. Records carry one `deliver-at` header and 100-byte values, as in the end-to-end bench.
The machine is shared, so compare the best rounds of runs made one after the other.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter

from confluent_kafka import Message

from sidecar.clock import SystemClock
from sidecar.metrics import Metrics
from sidecar.outbound.delivery import Delivery, Due
from sidecar.outbound.writer import Writer

TOPIC, PARTITION = "orders", 2


def measure(records: int, rounds: int, subscriptions: int) -> list[float]:
    """Microseconds per record of each round."""
    queue = {"queue.buffering.max.messages": 2_000_000, "queue.buffering.max.kbytes": 2_000_000}
    writer = Writer({"bootstrap.servers": "127.0.0.1:1"}, logging.getLogger("bench.librdkafka"), tuning=queue)
    delivery = Delivery(writer, {}, dict, {}, Metrics(), SystemClock())
    at = 1_795_680_000_000
    due: list[Due] = [
        (at + i, i, Message(TOPIC, PARTITION, i, None, b"x" * 100, [("deliver-at", b"%d" % at)], None, (1, at)))
        for i in range(records)
    ]
    targets = [(f"s{n}", f"{TOPIC}.s{n}") for n in range(subscriptions)]
    out: list[float] = []
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            delivery.send_many((TOPIC, PARTITION), targets, due, Counter())
            out.append((time.perf_counter() - started) / records * 1e6)
            writer.producer.purge(in_queue=True)
            writer.producer.poll(0)
    finally:
        writer.producer.purge(in_queue=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10_000, metavar="N", help="records per round")
    parser.add_argument("--rounds", type=int, default=40, metavar="N")
    parser.add_argument("--subscriptions", type=int, default=2, metavar="N")
    args = parser.parse_args(argv)
    times = sorted(measure(args.records, args.rounds, args.subscriptions))
    print("| records a round | rounds | subscriptions | best (µs/record) | median (µs/record) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {args.records:,} | {args.rounds} | {args.subscriptions} | {times[0]:.2f} | {times[len(times) // 2]:.2f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
