"""The Spark audit on N inbound and N x subscriptions outbound records: wall time and records per second.

Starts an embedded broker in a temporary directory, writes the records directly with confluent-kafka
(a batching producer; outbound records carry the contract's headers, every one on time), then runs
the audit job in this process on local[2] with the embedded Python Kafka source and prints a
markdown table. The SparkSession is started before the clock starts (its JVM start is reported apart).

Usage: .venv/bin/python bench/bench_audit.py [--inbound 1000000] [--subscriptions 2] [--partitions 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from sidecar.broker.embedded import EmbeddedBroker, free_port  # noqa: E402
from sidecar.outbound.records import outbound_headers  # noqa: E402
from spark.audit_job import audit  # noqa: E402
from spark.session import build_session  # noqa: E402
from spark.settings import AuditSettings  # noqa: E402


def produce(bootstrap: str, topic: str, inbound: int, subs: list[str], partitions: int) -> float:
    """Inbound records with a 1 s delay, and each delivered on time to every subscription."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 50,
            "batch.num.messages": 10_000,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 1_000_000,
            "compression.type": "lz4",
        }
    )
    started = time.monotonic()
    t0 = int(time.time() * 1000) - 3_600_000
    value = b"x" * 64
    delay = [("deliver-after", b"1s")]
    for i in range(inbound):
        partition = i % partitions
        while True:
            try:
                producer.produce(topic, value, headers=delay, partition=partition, timestamp=t0)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    producer.flush(120)
    # Inbound offsets per partition are 0.. in order, as written above.
    for sub in subs:
        for i in range(inbound):
            partition, offset = i % partitions, i // partitions
            headers = outbound_headers(delay, topic, partition, offset, t0 + 1000)
            while True:
                try:
                    producer.produce(
                        f"{topic}.{sub}", value, headers=headers, partition=partition, timestamp=t0 + 1000 + i % 50
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
            if i % 10_000 == 0:
                producer.poll(0)
    assert producer.flush(300) == 0
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inbound", type=int, default=1_000_000)
    parser.add_argument("--subscriptions", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--shuffle-partitions", type=int, default=8)
    parser.add_argument("--driver-memory", default="4g")
    args = parser.parse_args()
    subs = [f"s{i}" for i in range(args.subscriptions)]
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        tmp_path = Path(tmp)
        with EmbeddedBroker(tmp_path / "broker", port=free_port()) as broker:
            bootstrap = broker.bootstrap_servers
            topic = "bench.orders"
            admin = AdminClient({"bootstrap.servers": bootstrap})
            names = [topic, *(f"{topic}.{s}" for s in subs), f"{topic}.dlt"]
            for future in admin.create_topics([NewTopic(n, args.partitions) for n in names]).values():
                future.result(30)
            produce_s = produce(bootstrap, topic, args.inbound, subs, args.partitions)
            policies = tmp_path / "policies.yaml"
            policies.write_text(
                f"topics:\n  {topic}:\n    subscriptions: {{{', '.join(f'{s}: {{}}' for s in subs)}}}\n"
            )
            jvm_started = time.monotonic()
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            spark = build_session(
                args.master, driver_memory=args.driver_memory, shuffle_partitions=args.shuffle_partitions
            )
            spark.sparkContext.setLogLevel("ERROR")
            jvm_s = time.monotonic() - jvm_started
            settings = AuditSettings(
                bootstrap_servers=bootstrap,
                policies=policies,
                output_dir=tmp_path / "report",
                source="python",
                control_topic="",
                show_anomalies=0,
            )
            started = time.monotonic()
            with open(os.devnull, "w") as quiet:
                outcome = audit(settings, spark, out=quiet)
            wall = time.monotonic() - started
            spark.stop()
    outbound = args.inbound * len(subs)
    total = args.inbound + outbound
    anomalies = sum(outcome.result.anomaly_counts.values())
    print(f"\nAudit benchmark ({args.master}, Python Kafka source, {args.partitions} partitions per topic)\n")
    print("| inbound | outbound | records read | produce s | Spark start s | audit wall s | records/s | anomalies |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {args.inbound:,} | {outbound:,} | {total:,} | {produce_s:.1f} | {jvm_s:.1f} | {wall:.1f} "
        f"| {total / wall:,.0f} | {anomalies} |"
    )
    if anomalies or outcome.exit_code != 0:
        sys.exit(f"the benchmark's records should audit clean: {outcome.result.anomaly_counts}")


if __name__ == "__main__":
    main()
