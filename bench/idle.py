"""What an idle sidecar costs, and how late the first record after an idle spell is.

Usage: .venv/bin/python -m bench.idle [--runs 2] [--pauses 0,10] [--idle-s 60] [--window-s 20] [--written 0]

One broker (bench_broker: Apache Kafka unless DELAY_SIDECAR_BROKER_KIND says otherwise); each run
starts a sidecar on a fresh inbound topic of two partitions, with `--idle-fetch-pause-ms` set to
each of `--pauses` in turn, reads the sidecar's and the broker's CPU time (/proc) over consecutive
windows of its idle spell, then produces one record with no delay and times it to the outbound
topic. A sidecar idle since its start is where the suite's short-lived sidecars spend their lives,
and where inbound/idle_fetch.py's pacing is at its busiest. `--written N` writes N records to each
inbound partition before the sidecar starts: librdkafka wakes for a seek to an offset above 0 only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, Producer

from bench.probe import create_topic
from bench.procs import bench_broker, start_sidecar
from bench.report import command_line, dated_lines
from sidecar.broker import ApacheKafka, BrokerLauncher, EmbeddedBroker
from sidecar.broker.ports import free_port

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User and system CPU of a process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def broker_pid(broker: BrokerLauncher) -> int:
    """The process whose CPU is the broker's: the one node of Apache Kafka, or noida-db."""
    if isinstance(broker, ApacheKafka) and len(broker.nodes) == 1 and broker.nodes[0].process is not None:
        return broker.nodes[0].process.pid
    if isinstance(broker, EmbeddedBroker) and broker.pid is not None:
        return broker.pid
    raise SystemExit("bench.idle reads the CPU of a one-node broker it starts: unset DELAY_SIDECAR_NODES")


Run = tuple[list[float], list[float], float]
"""The sidecar's and the broker's shares of a core in each window, and the first record's lateness in ms."""


def one_run(
    bootstrap: str, broker: int, work: Path, pause_ms: int, idle_s: float, window_s: float, written: int
) -> Run:
    """One sidecar idle, then one record; `broker`: the broker's process id."""
    topic = f"idle-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 2)
    create_topic(bootstrap, f"{topic}.s", 2)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    for i in range(written * 2):  # read and delivered before the idle spell
        producer.produce(topic, b"before", partition=i % 2)
    producer.flush(30)
    policies = work / f"{topic}.yaml"
    policies.write_text(f"topics:\n  {topic}:\n    subscriptions:\n      s: {{}}\n")
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-reader", "auto.offset.reset": "earliest",
                       "isolation.level": "read_committed", "fetch.wait.max.ms": 5})  # fmt: skip
    reader.subscribe([f"{topic}.s"])
    sidecar = start_sidecar(
        bootstrap, policies, work / topic, free_port(), f"{topic}-group", work / f"{topic}.log",
        "--idle-fetch-pause-ms", str(pause_ms),
    )  # fmt: skip
    try:
        producer.list_topics(topic, timeout=30)  # connected and told the topic's leaders before the timing
        shares: list[float] = []
        broker_shares: list[float] = []
        delivered = 0
        for _ in range(int(idle_s // window_s)):
            before, broker_before, at = cpu_s(sidecar.pid), cpu_s(broker), time.monotonic()
            while time.monotonic() - at < window_s:
                record = reader.poll(0.2)  # the reader joins its group meanwhile, outside the sidecar's CPU
                delivered += record is not None and record.error() is None
            shares.append((cpu_s(sidecar.pid) - before) / (time.monotonic() - at))
            broker_shares.append((cpu_s(broker) - broker_before) / (time.monotonic() - at))
        if delivered != written * 2:
            raise RuntimeError(f"{delivered} of the {written * 2} records written before the spell delivered")
        sent = time.time()
        producer.produce(topic, b"first", partition=0)
        producer.flush(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            record = reader.poll(0.1)
            if record is not None and record.error() is None:
                return shares, broker_shares, (time.time() - sent) * 1000
        raise RuntimeError(f"the record did not reach {topic}.s within 60 s:\n{sidecar.tail()}")
    finally:
        sidecar.stop()
        reader.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, metavar="N", help="runs of each pause, by turns")
    parser.add_argument("--pauses", default="0,10", metavar="MS[,MS...]", help="--idle-fetch-pause-ms values")
    parser.add_argument("--idle-s", type=float, default=60.0, metavar="S", help="idle spell before the record")
    parser.add_argument("--written", type=int, default=0, metavar="N", help="records in each partition before")
    parser.add_argument("--window-s", type=float, default=20.0, metavar="S", help="CPU sampling window")
    args = parser.parse_args(argv)
    pauses = [int(p) for p in args.pauses.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        work = Path(tmp)
        broker = bench_broker(work / "broker")
        bootstrap = broker.start()
        try:
            dated = dated_lines(broker, command_line("bench.idle", argv))
            pid = broker_pid(broker)
            rows: dict[int, list[Run]] = {p: [] for p in pauses}
            for _ in range(args.runs):
                for pause in pauses:
                    rows[pause].append(one_run(bootstrap, pid, work, pause, args.idle_s, args.window_s, args.written))
        finally:
            broker.stop()
    windows = len(next(iter(rows.values()))[0][0])
    spans = [f"{i * args.window_s:.0f}-{(i + 1) * args.window_s:.0f} s" for i in range(windows)]
    heads = [f"sidecar, {span}" for span in spans] + [f"broker, {span}" for span in spans]
    print(dated)
    print()
    print("Shares of a core, one per run.")
    print()
    print("| --idle-fetch-pause-ms | " + " | ".join(heads) + " | first record after the idle spell, ms |")
    print("| ---: |" + " ---: |" * (2 * windows + 1))
    for pause, runs in rows.items():
        cells = [
            " / ".join(f"{share[i]:.3f}" for share in shares)
            for shares in ([r[0] for r in runs], [r[1] for r in runs])
            for i in range(windows)
        ]
        late = " / ".join(f"{r[2]:.0f}" for r in runs)
        print(f"| {pause} | " + " | ".join(cells) + f" | {late} (median {statistics.median(r[2] for r in runs):.0f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
