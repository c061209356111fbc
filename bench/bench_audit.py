"""The Spark audit on N inbound and N x subscriptions outbound records: where the time goes.

Starts a broker of its own in a temporary directory (Apache Kafka; DELAY_SIDECAR_BROKER_KIND=noida-db
for the fallback's figures), writes the records directly with confluent-kafka (a batching producer;
outbound records carry the contract's headers, every one on time), then runs the audit job in this
process on local[2] with the embedded Python Kafka source and prints a markdown table: Spark
start-up (the JVM and session), then the audit's own phases (snapshot of the offsets, read = Kafka
into the cached, reduced inputs, analysis, write of the anomalies and chart), the CPU seconds this
process and its children used (JVM and Python workers), the memory the cached inputs took per
million records, and the load average (the machine is shared: compare CPU, not only wall time).

Usage: .venv/bin/python -m bench.bench_audit [--inbound 1000000] [--subscriptions 2] [--partitions 4]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from confluent_kafka import Producer  # noqa: E402

from bench.probe import create_topic  # noqa: E402
from bench.procs import bench_broker  # noqa: E402
from bench.report import command_line, dated_lines  # noqa: E402
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
    delay: list[tuple[str, bytes | None]] = [("deliver-after", b"1s")]
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


def cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the Spark JVM is one, when it exits)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def jvm_cpu_seconds(spark: Any) -> float:
    """CPU of the Spark JVM so far (a live child: not in RUSAGE_CHILDREN yet), from /proc."""
    pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cached_mb(spark: Any) -> float:
    """Memory (plus disk) of every cached DataFrame right now, in MB."""
    infos = spark.sparkContext._jsc.sc().getRDDStorageInfo()
    return sum(int(i.memSize()) + int(i.diskSize()) for i in infos) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inbound", type=int, default=1_000_000)
    parser.add_argument("--subscriptions", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--shuffle-partitions", type=int, default=None, help="default: sized by the audit")
    parser.add_argument("--driver-memory", default="4g")
    args = parser.parse_args(argv)
    subs = [f"s{i}" for i in range(args.subscriptions)]
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        tmp_path = Path(tmp)
        with bench_broker(tmp_path / "broker") as broker:
            bootstrap = broker.bootstrap_servers
            dated = dated_lines(broker, command_line("bench.bench_audit", argv))
            topic = "bench.orders"
            for name in [topic, *(f"{topic}.{s}" for s in subs), f"{topic}.dlt"]:
                create_topic(bootstrap, name, args.partitions)
            produce_s = produce(bootstrap, topic, args.inbound, subs, args.partitions)
            policies = tmp_path / "policies.yaml"
            policies.write_text(
                f"topics:\n  {topic}:\n    subscriptions: {{{', '.join(f'{s}: {{}}' for s in subs)}}}\n"
            )
            load_before = os.getloadavg()[0]
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
                shuffle_partitions=args.shuffle_partitions,
            )
            # The cached inputs' size, sampled while the analysis runs (they are dropped at the end).
            import spark.analysis as analysis_module  # noqa: PLC0415

            peak_cache = [0.0]
            analyse = analysis_module.analyse

            def measured(*a: Any, **k: Any) -> Any:
                peak_cache[0] = cached_mb(spark)
                return analyse(*a, **k)

            import spark.audit_job as job_module  # noqa: PLC0415

            job_module.analyse = measured  # type: ignore[attr-defined]
            cpu_before, jvm_before = cpu_seconds(), jvm_cpu_seconds(spark)
            started = time.monotonic()
            with open(os.devnull, "w") as quiet:
                outcome = audit(settings, spark, out=quiet)
            wall = time.monotonic() - started
            cpu = cpu_seconds() - cpu_before + jvm_cpu_seconds(spark) - jvm_before
            load_after = os.getloadavg()[0]
            spark.stop()
    outbound = args.inbound * len(subs)
    total = args.inbound + outbound
    anomalies = sum(outcome.result.anomaly_counts.values())
    t = outcome.report["timings_s"]
    shuffle = outcome.report["spark"]["shuffle_partitions"]
    print(f"\n{dated}\n")
    print(f"Audit benchmark ({args.master}, Python Kafka source, {args.partitions} partitions per topic, ", end="")
    print(f"{shuffle} shuffle partitions, maxRecordsPerPartition {settings.max_records_per_partition:,})\n")
    print(
        "| inbound | outbound | produce s | Spark start-up s | snapshot s | read s | analysis s | write s "
        "| audit wall s | start-up + audit s | records/s | CPU s (all processes) | cache MB per 1M records "
        "| load avg before/after | anomalies |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {args.inbound:,} | {outbound:,} | {produce_s:.1f} | {jvm_s:.1f} | {t['snapshot']:.1f} | {t['read']:.1f} "
        f"| {t['analysis']:.1f} | {t['write']:.1f} | {wall:.1f} | {jvm_s + wall:.1f} | {total / wall:,.0f} "
        f"| {cpu:.0f} | {peak_cache[0] / (total / 1e6):.0f} | {load_before:.1f} / {load_after:.1f} | {anomalies} |"
    )
    if anomalies or outcome.exit_code != 0:
        print(f"the benchmark's records should audit clean: {outcome.result.anomaly_counts}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
