"""The ceiling: the leanest at-least-once Kafka relay Python can run with confluent-kafka.

Consume the inbound topic in batches, produce each record (key, value, headers) to every outbound
topic given (one: the bare ceiling; two: the same-I/O relay, which writes as many records per input
as the sidecar does for two subscriptions, so a ratio against it shows what the sidecar's own work
costs rather than its fan-out), and every `--commit-interval-ms` flush the producer and commit the consumed offsets. No
per-record Python beyond the produce call and an error check. The producer settings are the
sidecar's (idempotence, lz4, linger 5 ms), so the comparison isolates what the sidecar does per
record, not client tuning.

`--contract-headers` adds what the contract's compact form asks of every delivery (docs/contract.md
section 4): the inbound partition number kept, and the two headers `delay-origin` and
`delay-deliver-at` (here the record's timestamp, as for a record delivered at once) appended to the
record's own. That relay is the floor of any sidecar honouring the contract in one Python process:
it pays the contract's per-record cost and nothing else.

Usage: python -m bench.relay --bootstrap HOST:PORT --inbound T --outbound O [--outbound O2 ...] --group G
Runs until SIGTERM or SIGINT, then flushes and commits once more.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from confluent_kafka import Consumer, Message, Producer

BATCH = 10_000


def relay(
    bootstrap: str,
    inbound: str,
    outbound: list[str],
    group: str,
    commit_interval_ms: int = 1000,
    contract_headers: bool = False,
) -> int:
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
        if contract_headers:
            _with_headers(records, outbound, producer)
        else:
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


def _with_headers(records: list[Message], outbound: list[str], producer: Producer) -> None:
    """Each record to each topic on its own partition number, with the compact form's two headers."""
    produce = producer.produce
    prefixes: dict[int, bytes] = {}
    for m in records:
        if m.error() is not None:
            continue
        number, offset = m.partition(), m.offset()
        prefix = prefixes.get(number)
        if prefix is None:  # once per partition, as the sidecar does
            prefix = prefixes[number] = b"%s/%d/" % (m.topic().encode(), number)
        original = m.headers()
        headers = [(k, v if v is not None else b"") for k, v in original] if original else []
        headers.append(("delay-origin", prefix + b"%d" % offset))
        headers.append(("delay-deliver-at", b"%d" % m.timestamp()[1]))
        value, key = m.value(), m.key()
        for topic in outbound:
            try:
                produce(topic, value, key, headers=headers, partition=number)
            except BufferError:
                producer.poll(0.05)
                produce(topic, value, key, headers=headers, partition=number)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--inbound", required=True)
    parser.add_argument("--outbound", required=True, action="append", help="repeat for several (each record to each)")
    parser.add_argument("--group", required=True)
    parser.add_argument("--commit-interval-ms", type=int, default=1000)
    parser.add_argument("--contract-headers", action="store_true", help="what the contract asks of each delivery")
    args = parser.parse_args(argv)
    relay(args.bootstrap, args.inbound, args.outbound, args.group, args.commit_interval_ms, args.contract_headers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
