"""What each outbound header costs a producer: the measurement behind issue 13's pass-through item.

Usage: .venv/bin/python -m bench.header_cost [--records N] [--rounds N]

Produces N 100-byte records to a broker of its own (Apache Kafka; DELAY_SIDECAR_BROKER_KIND=noida-db
for the fallback's figures) with 0 to 5 headers of the contract's shape, and a single compact origin
header as the alternative, each in the same run, and prints records/s and the ratio to no headers.
Only the produce calls and the final flush are timed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Producer

from bench.probe import create_topic
from bench.procs import bench_broker
from bench.report import command_line, dated_lines
from sidecar.outbound.records import outbound_headers

CONTRACT = outbound_headers(None, "orders", 3, 1_234_567, 1_795_255_200_000)
SHAPES: dict[str, list[tuple[str, bytes]]] = {
    "none": [],
    "1 header": CONTRACT[:1],
    "3 headers (origin)": CONTRACT[:3],
    "5 headers (the contract)": CONTRACT,
    "1 compact header (topic/partition/offset@deliver_at#count)": [
        ("delay-origin", b"orders/3/1234567@1795255200000#0")
    ],
    "2 headers (the compact form: delay-origin, delay-deliver-at)": [
        ("delay-origin", b"orders/3/1234567"),
        ("delay-deliver-at", b"1795255200000"),
    ],
}


def produce(bootstrap: str, topic: str, headers: list[tuple[str, bytes]], records: int) -> float:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "compression.type": "lz4",
                         "queue.buffering.max.messages": 1_000_000})  # fmt: skip
    value = b"x" * 100
    started = time.perf_counter()
    for i in range(records):
        while True:
            try:
                producer.produce(topic, value, headers=headers)
                break
            except BufferError:
                producer.poll(0.01)
        if i % 10_000 == 0:
            producer.poll(0)
    producer.flush(60)
    return records / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000, metavar="N")
    parser.add_argument("--rounds", type=int, default=3, metavar="N", help="best of N, in alternating order")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="header-cost-") as work:
        broker = bench_broker(Path(work) / "broker")
        with broker:
            dated = dated_lines(broker, command_line("bench.header_cost", argv))
            names = [f"h{i}" for i in range(len(SHAPES))]
            for name in names:
                create_topic(broker.bootstrap_servers, name, 1)
            rates: dict[str, float] = {}
            order = list(zip(SHAPES.items(), names, strict=True))
            for round_ in range(args.rounds):  # alternate the order: the machine is shared and noisy
                for (shape, headers), name in order if round_ % 2 == 0 else order[::-1]:
                    rate = produce(broker.bootstrap_servers, name, headers, args.records)
                    rates[shape] = max(rates.get(shape, 0.0), rate)
    base = rates["none"]
    print(dated + "\n")
    print(f"| headers per record ({args.records:,} records of 100 B) | records/s | ratio to none |")
    print("| --- | ---: | ---: |")
    for shape, rate in rates.items():
        print(f"| {shape} | {rate:,.0f} | {rate / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
