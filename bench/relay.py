"""The ceiling: the leanest at-least-once Kafka relay Python can run with confluent-kafka.

Consume the inbound topic in batches, produce each record (key, value, headers) to every outbound
topic given (one: the bare ceiling; two: the same-I/O relay, which writes as many records per input
as the sidecar does for two subscriptions, so a ratio against it shows what the sidecar's own work
costs rather than its fan-out), and every `--commit-interval-ms` flush the producer and commit the consumed offsets. No
per-record Python beyond the produce call and an error check. The producer settings are the
sidecar's (idempotence, lz4, linger 5 ms), so the comparison isolates what the sidecar does per
record, not client tuning.

Usage: python -m bench.relay --bootstrap HOST:PORT --inbound T --outbound O [--outbound O2 ...] --group G
Runs until SIGTERM or SIGINT, then flushes and commits once more.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from confluent_kafka import Consumer, Producer

BATCH = 10_000


def relay(bootstrap: str, inbound: str, outbound: list[str], group: str, commit_interval_ms: int = 1000) -> int:
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 10,
        }
    )
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "linger.ms": 5,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 1_000_000,
            "delivery.report.only.error": True,
        }
    )
    consumer.subscribe([inbound])
    produce, consume = producer.produce, consumer.consume
    relayed = 0
    interval_s = commit_interval_ms / 1000
    last_commit = time.monotonic()
    dirty = False
    while not stopping:
        records = consume(BATCH, 0.1)
        for m in records:
            if m.error() is None:
                value, key, headers = m.value(), m.key(), m.headers()
                for topic in outbound:
                    try:
                        produce(topic, value, key, headers=headers)
                    except BufferError:
                        producer.poll(0.05)
                        produce(topic, value, key, headers=headers)
        if records:
            relayed += len(records)
            dirty = True
            producer.poll(0)
        if dirty and time.monotonic() - last_commit >= interval_s:
            producer.flush(30)
            consumer.commit(asynchronous=False)
            last_commit, dirty = time.monotonic(), False
    producer.flush(30)
    if dirty:
        consumer.commit(asynchronous=False)
    consumer.close()
    return relayed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--inbound", required=True)
    parser.add_argument("--outbound", required=True, action="append", help="repeat for several (each record to each)")
    parser.add_argument("--group", required=True)
    parser.add_argument("--commit-interval-ms", type=int, default=1000)
    args = parser.parse_args(argv)
    relay(args.bootstrap, args.inbound, args.outbound, args.group, args.commit_interval_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
