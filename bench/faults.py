"""Faults from outside under a steady load, and what each one cost: the fault table of docs/reliability.md.

Usage: .venv/bin/python -m bench.faults [--rate 2000] [--broker-restarts 5] [--kills 3] [--outage-s 3]

Each scenario runs the sidecar as a process against a broker of its own (Apache Kafka, stopped and
started again with the same ports and data; DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback's
figures), produces delayed records (deliver-after 0-5 s) to an inbound topic of 3 partitions at a
steady rate while the fault happens, then reads every outbound topic to its end and counts, per
subscription: records lost, duplicated and delivered early. It samples /healthz every 100 ms, and
reports the recovery time: from the end of the fault to ready.
The test suite runs a short version (tests/test_faults.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from bench.probe import LiveReader, create_topic
from bench.procs import ROOT, Child, bench_broker
from bench.report import command_line, dated_lines
from sidecar.broker.ports import free_port
from sidecar.outbound.records import read_delivery

SUBSCRIPTIONS = ("shared", "ordered")
GUARANTEE = ["at-least-once"]
ISOLATION = ["read_uncommitted"]
POLICY = "topics:\n  faults:\n    subscriptions: {shared: {}, ordered: {type: exclusive}}\n"
PARTITIONS = 3


@dataclass
class Row:
    fault: str
    runs: int
    produced: int = 0
    lost: int = 0
    duplicated: int = 0
    early: int = 0
    recovery_s: list[float] = field(default_factory=list)
    health: Counter[str] = field(default_factory=Counter)
    note: str = ""
    live_lost: int | None = None
    live_duplicated: int | None = None


def health(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return str(json.loads(response.read())["status"])
    except urllib.error.HTTPError as e:
        reasons = json.loads(e.read()).get("reasons") or ["?"]
        return f"503 {str(reasons[0]).split(':')[0]}"
    except OSError:
        return "no answer"


class Load:
    """Delayed records at a steady rate, from a thread, until stopped."""

    def __init__(self, bootstrap: str, rate: int) -> None:
        quiet = logging.getLogger("bench.faults.load")
        quiet.setLevel(logging.CRITICAL)  # the outages are on purpose
        self._producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5}, logger=quiet)
        self._rate = rate
        self._stop = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            due = int((time.monotonic() - started) * self._rate)
            while self.sent < due:
                delay = random.randint(0, 5_000)
                try:
                    self._producer.produce("faults", b"x" * 100, headers=[("deliver-after", str(delay))])
                    self.sent += 1
                except BufferError:
                    break
            self._producer.poll(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        while self._producer.flush(5):
            pass  # the broker may still be restarting: every record must be written before counting
        return self.sent


def read_to_end(bootstrap: str, topic: str) -> list[tuple[int, int, int, int, int]]:
    """(origin partition, origin offset, redelivery count, timestamp, deliver-at) of every record,
    as a consumer of the outbound topic sees them (read_committed in exactly-once runs)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"faults-{time.time_ns()}",
                         "enable.partition.eof": True, "enable.auto.commit": False,
                         "isolation.level": ISOLATION[0]})  # fmt: skip
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        ends = {p: end for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        out = []
        while ends:
            for m in consumer.consume(10_000, 0.5):
                if m.error() is None and m.offset() < ends.get(m.partition(), -1):
                    d = read_delivery(dict(m.headers() or []))
                    out.append((d.partition, d.offset, d.redelivery_count, m.timestamp()[1], d.deliver_at))
                if m.partition() in ends and m.offset() >= ends[m.partition()] - 1:
                    del ends[m.partition()]
        return out
    finally:
        consumer.close()


class Rig:
    """A broker and a sidecar of their own, in a temporary directory."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.broker = bench_broker(work / "broker")
        self.bootstrap = self.broker.start()
        # Created here, not by the load's first record: an auto-created topic gets the broker's
        # default partition count (1 on the Apache Kafka the benches start), and the readers want 3.
        create_topic(self.bootstrap, "faults", PARTITIONS)
        self.policies = work / "policies.yaml"
        self.policies.write_text(POLICY)
        self.port = free_port()
        self.sidecar: Child | None = None
        self.live: tuple[LiveReader, dict[str, Counter[tuple[int, int]]]] | None = None

    def start_sidecar(self) -> None:
        self.sidecar = Child([sys.executable, "-m", "sidecar", "run", "--bootstrap-servers", self.bootstrap,
                              "--policies", str(self.policies), "--state-dir", str(self.work / "state"),
                              "--metrics-port", str(self.port), "--group-id", "faults",
                              "--commit-interval-ms", "200", "--processing-guarantee", GUARANTEE[0]],
                             self.work / "sidecar.log")  # fmt: skip

    def wait_ready(self, timeout_s: float = 120) -> float:
        """Seconds until /healthz says ready."""
        started = time.monotonic()
        while (status := health(self.port)) != "ready":
            if time.monotonic() - started > timeout_s:
                log = self.sidecar.tail(3000) if self.sidecar is not None else ""
                raise RuntimeError(f"not ready after {timeout_s:.0f} s: {status}\n{log}")
            time.sleep(0.1)
        return time.monotonic() - started

    def count(self, row: Row, produced: int) -> None:
        row.produced = produced
        for sub in SUBSCRIPTIONS:
            deadline = time.monotonic() + 120
            while True:
                records = read_to_end(self.bootstrap, f"faults.{sub}")
                copies = Counter((p, o) for p, o, count, _, _ in records if count == 0)
                if len(copies) >= produced or time.monotonic() > deadline:
                    break
                time.sleep(1)
            row.lost += produced - len(copies)
            row.duplicated += sum(copies.values()) - len(copies)
            row.early += sum(1 for *_, ts, at in records if ts < at)
        if self.live is not None:  # a consumer that kept reading through the faults, once all is delivered
            reader, seen = self.live
            if not reader.finish(120):
                print("live reader: not caught up after 120 s; its counts are of what it read", flush=True)
            row.live_lost = sum(produced - len(copies) for copies in seen.values())
            row.live_duplicated = sum(sum(copies.values()) - len(copies) for copies in seen.values())

    def close(self) -> None:
        if self.sidecar is not None:
            self.sidecar.stop()
        self.broker.stop()


def live_reader(bootstrap: str) -> tuple[LiveReader, dict[str, Counter[tuple[int, int]]]]:
    """A reader of both outbound topics through the faults, and its first copies per origin."""
    copies: dict[str, Counter[tuple[int, int]]] = {s: Counter() for s in SUBSCRIPTIONS}

    def take(m: Message) -> None:
        d = read_delivery(dict(m.headers() or []))
        if d.redelivery_count == 0:
            copies[m.topic().split(".", 1)[1]][(d.partition, d.offset)] += 1

    topics = [f"faults.{s}" for s in SUBSCRIPTIONS]
    return LiveReader(bootstrap, topics, PARTITIONS, take, ISOLATION[0]), copies


def sample_health(rig: Rig, row: Row, during: Callable[[], None]) -> None:
    """Run `during` while /healthz is sampled every 100 ms into the row."""
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            row.health[health(rig.port)] += 1
            time.sleep(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        during()
    finally:
        done.set()
        thread.join()


def broker_restarts(rig: Rig, args: argparse.Namespace) -> Row:
    row = Row("broker restart (stop, outage, start)", args.broker_restarts)
    try:
        rig.start_sidecar()
        rig.wait_ready()
        rig.live = live_reader(rig.bootstrap)
        load = Load(rig.bootstrap, args.rate).start()
        for _ in range(args.broker_restarts):
            time.sleep(2)

            def outage() -> None:
                rig.broker.stop()
                time.sleep(args.outage_s)
                rig.broker.start()

            sample_health(rig, row, outage)
            row.recovery_s.append(rig.wait_ready())
        produced = load.stop()
        assert rig.sidecar is not None and rig.sidecar.alive(), rig.sidecar.tail() if rig.sidecar else ""
        rig.count(row, produced)
        log = (rig.work / "sidecar.log").read_text()
        row.note = f"engine restarts {log.count('engine failed')}, client log lines {log.count('logger=librdkafka')}"
    finally:
        rig.close()
    return row


def sidecar_kills(rig: Rig, args: argparse.Namespace) -> Row:
    row = Row("kill -9 of the sidecar, restart", args.kills)
    try:
        rig.start_sidecar()
        rig.wait_ready()
        rig.live = live_reader(rig.bootstrap)
        load = Load(rig.bootstrap, args.rate).start()
        for _ in range(args.kills):
            time.sleep(3)
            assert rig.sidecar is not None
            rig.sidecar.process.send_signal(signal.SIGKILL)
            rig.sidecar.process.wait()
            started = time.monotonic()
            rig.start_sidecar()
            rig.wait_ready()
            row.recovery_s.append(time.monotonic() - started)
        row.health["ready"] += 1
        rig.count(row, load.stop())
        row.note = (
            "at least once: duplicates are what was delivered since the last checkpoint"
            if GUARANTEE[0] == "at-least-once"
            else "exactly-once: read_committed readers must see each record once"
        )
    finally:
        rig.close()
    return row


def empty_policies(rig: Rig, args: argparse.Namespace) -> Row:
    row = Row("policies saved empty for 2 s (truncate, then write)", 1)
    try:
        rig.start_sidecar()
        rig.wait_ready()
        load = Load(rig.bootstrap, args.rate).start()
        time.sleep(2)

        def empty_save() -> None:
            rig.policies.write_text("")
            time.sleep(2)
            rig.policies.write_text(POLICY)

        sample_health(rig, row, empty_save)
        row.recovery_s.append(rig.wait_ready())
        rig.count(row, load.stop())
        row.note = "the empty load is refused; the topic stays served"
    finally:
        rig.close()
    return row


def wrong_sasl(rig: Rig, args: argparse.Namespace) -> Row:
    row = Row("SCRAM settings against a plaintext listener", 1)
    try:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "sidecar", "run", "--bootstrap-servers", rig.bootstrap, "--policies",
             str(rig.policies), "--state-dir", str(rig.work / "state"), "--metrics-port", "0",
             "--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism", "SCRAM-SHA-512",
             "--sasl-username", "u", "--sasl-password", "p"],
            capture_output=True, cwd=ROOT, timeout=120, check=False,
        )  # fmt: skip
        row.recovery_s.append(time.monotonic() - started)
        lines = done.stderr.decode().strip().splitlines()
        row.health[f"exit {done.returncode}"] += 1
        row.note = f"{len(lines)} log lines; last: {lines[-1][:90] if lines else ''}"
    finally:
        rig.close()
    return row


SCENARIOS = {"broker": broker_restarts, "kill": sidecar_kills, "policies": empty_policies, "sasl": wrong_sasl}


def table(rows: list[Row]) -> str:
    lines = ["| fault | runs | records | lost | duplicated | early | live reader lost / duplicated | recovery s (max) "
             "| /healthz during it | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]  # fmt: skip
    for r in rows:
        seen = ", ".join(f"{status} x{n}" for status, n in r.health.most_common())
        recovery = f"{max(r.recovery_s):.1f}" if r.recovery_s else "-"
        live = "-" if r.live_lost is None else f"{r.live_lost} / {r.live_duplicated}"
        lines.append(f"| {r.fault} | {r.runs} | {r.produced:,} | {r.lost} | {r.duplicated} | {r.early} | {live} | "
                     f"{recovery} | {seen} | {r.note} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=2_000, metavar="N", help="records produced per second")
    parser.add_argument("--broker-restarts", type=int, default=5, metavar="N")
    parser.add_argument("--kills", type=int, default=3, metavar="N")
    parser.add_argument("--outage-s", type=float, default=3.0, metavar="S", help="how long the broker stays down")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), metavar="LIST", help=",".join(SCENARIOS))
    parser.add_argument("--exactly-once", action="store_true", help="exactly-once mode; read_committed readers")
    args = parser.parse_args(argv)
    if args.exactly_once:
        GUARANTEE[0], ISOLATION[0] = "exactly-once", "read_committed"
    rows = []
    dated = ""
    for name in args.scenarios.split(","):
        with tempfile.TemporaryDirectory(prefix=f"faults-{name}-") as work:
            rig = Rig(Path(work))
            note = "a fresh one for each scenario"
            dated = dated or dated_lines(rig.broker, command_line("bench.faults", argv), note)
            rows.append(SCENARIOS[name](rig, args))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(dated + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
