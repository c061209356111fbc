"""The chaos run of issue 14: exactly-once delivery through kill -9, a lost state dir, a broker
restart and a zombie, with nacks, checked by counting every record of every subscription.

Usage: .venv/bin/python -m bench.chaos [--records 20000] [--kills 20] [--seed 14] [--no-broker-restart]
       [--no-state-loss] [--no-zombie] [--window-s 30]

A broker of its own (Apache Kafka, stopped and started again with the same ports and data for the
broker restart; DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback's figures), one inbound topic
with two subscriptions: `shared` (shared) and `excl` (exclusive, delivered at publish time). Records
carry deliver-after 0 to `window` seconds. A consumer of `shared` (read_committed) nacks 5% of what
it receives (--nack-fraction), once each, 1 to 5 s later. While records fall due, the sidecar
(exactly-once) is killed with SIGKILL and started again on its state dir `--kills` times; once the
state dir is deleted before the restart; the broker is stopped and started once; and once the
sidecar is stopped with SIGSTOP, a second sidecar with the same instance id takes its place, and the
first is woken (SIGCONT): it must be fenced. At the end every outbound topic is read to its high
watermark, read_committed, and counted per record (`audit`), and the records of `excl` are checked
for their order: each inbound partition's on the outbound partition of its number, first copies in
inbound order.

With --spark-audit, `delay-sidecar audit` then judges the same topics independently. The run passes
only if the audit exits 0 AND its counts equal the bench's own (`disagreements`): two oracles that
disagree mean a bug in one of them, whichever looks clean.

The test suite runs a short version (tests/test_chaos.py), with the Spark audit in its own process's
session; the full one writes docs/reliability.md's table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.probe import create_topic, group_commits, now_ms
from bench.procs import Child, bench_broker
from bench.report import command_line, dated_lines
from sidecar.client import Nacker
from sidecar.outbound.records import read_delivery
from sidecar.partitions.metadata import CommitMetadata

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parents[1]
TOPIC, PARTITIONS, CONTROL = "chaos", 2, "delay-sidecar.control"
PRODUCER = re.compile(r"event=\"transactional producer\" transactional_id=(\S+)")
"""A process's log line naming each producer it opens (outbound/writer.py)."""
# noida-db lists aborted transactions that ended before a fetch's offset, and librdkafka then drops
# the later records of that producer (tests/broker/test_transactions.py): readers here start at
# offset 0 and take each partition in one fetch, so they see every abort marker in order. Apache
# Kafka needs none of this (it lists only the aborts a fetch's range overlaps); the large limits
# cost it nothing at these sizes, so both brokers are read the same way.
WHOLE_PARTITION_FETCH = {
    "max.partition.fetch.bytes": 256 * 1024 * 1024,
    "fetch.max.bytes": 512 * 1024 * 1024,
    "receive.message.max.bytes": 600 * 1024 * 1024,
}
SUBSCRIPTIONS = ("shared", "excl")
HELD_EVERY = 100
HOLD_S = 60.0
ORDERED = ("excl",)
"""Subscriptions that promise inbound order (exclusive). Exclusive from the start, so none of their
records is ever delayed: every first copy is an at-once delivery, in the order check."""
# An in-process audit still running after this long has its Spark JVM's thread stacks written beside its report.
AUDIT_STACKS_AFTER_S = 240.0


@dataclass
class Plan:
    records: int = 20_000
    kills: int = 20
    window_s: float = 30.0
    seed: int = 14
    broker_restart: bool = True
    state_loss: bool = True
    zombie: bool = True
    commit_interval_ms: int = 500
    nack_fraction: float = 0.05
    cancel_fraction: float = 0.0
    """Records cancelled while the faults go on, each some time between its production and a window later."""
    spark_audit: bool = False
    hold_s: float = HOLD_S
    """How much later than the others the held records fall due (`held`)."""

    def held(self, i: int) -> bool:
        """Record `i` is one of those held back and always cancelled: with cancels on, every
        HELD_EVERY-th record falls due `hold_s` after the window, so its cancel (sent within the
        window) is in time even when a loaded machine leaves the sidecar further behind than the
        window. Cancels of the others race their records, so the run has both outcomes on any machine:
        in CI, with the sidecar 15 s behind, all 78 cancels of a run had come too late. The run
        waits for every held record to fall due before it counts: after the faults, so a cancel
        that a kill, a lost state dir or the zombie forgot would show as a delivered record."""
        return self.cancel_fraction > 0 and i % HELD_EVERY == 0


@dataclass
class Audit:
    """Per subscription: records lost, extra copies, early ones; nacks sent, redelivered, bad."""

    lost: dict[str, int] = field(default_factory=dict)
    duplicated: dict[str, int] = field(default_factory=dict)
    early: dict[str, int] = field(default_factory=dict)
    nacks_sent: int = 0
    nacks_redelivered: int = 0
    nacks_cancelled: int = 0
    """Nacked records whose pending redelivery a cancel took back (never redelivered)."""
    nacks_missing_or_early: int = 0
    redeliveries_unasked: int = 0
    redelivered: dict[str, int] = field(default_factory=dict)
    """Distinct (record, redelivery count > 0) per subscription: what the Spark audit calls redelivered."""
    out_of_order: dict[str, int] = field(default_factory=dict)
    """Per ordered subscription: first copies written before the one of their inbound predecessor."""
    wrong_partition: dict[str, int] = field(default_factory=dict)
    """Per ordered subscription: first copies on another outbound partition than their inbound one."""
    written: dict[str, int] = field(default_factory=dict)
    """Distinct records written at least once, committed or not (read_uncommitted): a record lost
    read_committed but written was lost by the reader, not by the sidecar."""
    cancels_sent: int = 0
    cancelled: int = 0
    """Cancels answered `cancelled` (read_committed): those records must not reach `shared`."""
    cancelled_delivered: int = 0
    """Records answered `cancelled` that reached `shared` anyway."""
    cancels_not_answered_once: int = 0

    @property
    def anomalies(self) -> int:
        return (
            sum(self.lost.values())
            + sum(self.duplicated.values())
            + sum(self.early.values())
            + self.nacks_missing_or_early
            + self.redeliveries_unasked
            + sum(self.out_of_order.values())
            + sum(self.wrong_partition.values())
            + self.cancelled_delivered
            + self.cancels_not_answered_once
        )


@dataclass
class SparkAudit:
    """`delay-sidecar audit` over the run (read_committed): its exit code and report.json's counts."""

    exit_code: int
    seconds: float
    subscriptions: dict[str, dict[str, Any]] = field(default_factory=dict)
    """report.json's summary per subscription of TOPIC; empty when the audit wrote no report."""
    anomaly_counts: dict[str, int] = field(default_factory=dict)
    output: str = ""
    """The last lines it printed: its verdict and anomalies, or why it could not run."""
    disagreements: list[str] = field(default_factory=list)
    """Each count where it and the bench's own counter differ."""
    report: dict[str, Any] = field(default_factory=dict)
    """report.json as written, for runs over several topics (bench/churn.py)."""

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and not self.disagreements


@dataclass
class Outcome:
    plan: Plan
    audit: Audit
    kills: int = 0
    restarts: int = 0
    broker_restarts: int = 0
    state_dirs_deleted: int = 0
    zombie: str | None = None
    """How the woken zombie stopped (`zombie`), or None: no zombie in the plan."""
    held_due: int = 0
    """Held records (`Plan.held`) whose due instant passed, after the last fault, before the count."""
    aborted_records: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    spark: SparkAudit | None = None
    """The Spark audit's verdict and counts, when it ran."""
    dated: str = ""
    """The run's dated header (date, commit, command, broker, machine load), for above its table."""

    @property
    def passed(self) -> bool:
        """No anomaly by the bench's count, the zombie stopped, nothing noted, and the Spark audit (when
        it ran) exited 0 with the same counts."""
        return (
            self.audit.anomalies == 0
            and self.zombie != WENT_ON
            and not self.notes
            and (self.spark is None or self.spark.passed)
        )


class Sidecar:
    """The sidecar under test: one process at a time (two during the zombie), started on demand."""

    def __init__(
        self,
        workdir: Path,
        bootstrap: str,
        policies: Path,
        plan: Plan,
        name: str,
        *,
        instance_id: str = "chaos-member",
        group: str = "chaos",
        guarantee: str = "exactly-once",
    ) -> None:
        """`instance_id`, `group`, `guarantee`: the churn run's (bench/churn.py) members differ."""
        self.workdir, self.state = workdir, workdir / f"state-{name}"
        self.log = workdir / f"sidecar-{name}.log"
        self.args = [sys.executable, "-m", "sidecar", "run", "--bootstrap-servers", bootstrap,
                     "--policies", str(policies), "--state-dir", str(self.state), "--metrics-port", "0",
                     "--group-id", group, "--instance-id", instance_id, "--processing-guarantee",
                     guarantee, "--commit-interval-ms", str(plan.commit_interval_ms),
                     # The churn run's members stop without leaving the group and hand their
                     # partitions on; on one broker no follower holds the heartbeats back, so the
                     # run keeps the takeover of before the 45 s default.
                     "--session-timeout-ms", "15000"]  # fmt: skip
        self.child: Child | None = None
        self.started_at = 0
        """Where this process's lines begin in the log (it is shared with earlier ones)."""
        # Each sidecar as if on a host of its own: the zombie's successor shares its instance id,
        # which the host-wide identity lock would refuse on one host (sidecar/identity.py).
        self.host = workdir / f"host-{name}"
        self.host.mkdir(exist_ok=True)

    def start(self) -> None:
        self.started_at = len(self.log.read_text(errors="replace")) if self.log.exists() else 0
        self.child = Child(self.args, self.log, env={"TMPDIR": str(self.host)})

    def claimed(self, bootstrap: str, group: str = "chaos") -> bool:
        """This process's producer is named by the group's last commit of every partition of TOPIC:
        it has claimed them (identity.py), and a successor can fence it by that name."""
        producers = PRODUCER.findall(self.log.read_text(errors="replace")[self.started_at :])
        if not producers:
            return False
        try:
            commits = group_commits(bootstrap, group, TOPIC, PARTITIONS, stable=False)
        except KafkaException:  # asked again by the caller's loop
            return False
        return all(CommitMetadata.decode(metadata).producer == producers[-1] for _, metadata in commits)

    def kill(self) -> None:
        if self.child is not None and self.child.alive():
            self.child.process.send_signal(signal.SIGKILL)
            self.child.process.wait(30)

    def signal(self, signum: int) -> None:
        assert self.child is not None
        os.kill(self.child.pid, signum)

    def stop(self) -> int:
        return self.child.stop() if self.child is not None else 0


class Background:
    """A loop on a thread of its own until stopped; an exception it raises is kept for the outcome."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # reported in the outcome
            self.error = e

    def _loop(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)


class Nacks(Background):
    """A read_committed consumer of `shared` that nacks a fixed 5% of the records, once each."""

    def __init__(self, bootstrap: str, seed: int, fraction: float) -> None:
        super().__init__()
        self._bootstrap, self._rng, self._fraction = bootstrap, random.Random(seed + 1), fraction
        self.sent: dict[tuple[int, int], int] = {}
        """(origin partition, origin offset) -> the earliest instant it may come back (ms)."""

    def start(self) -> Nacks:
        self._thread.start()
        return self

    def _loop(self) -> None:
        """A long-lived consumer would stop seeing the sidecar's records after its first aborted
        transaction on noida-db (see WHOLE_PARTITION_FETCH), so the topic is read again from the
        start every half second, and only records not seen before are considered (on either broker,
        so that both runs nack alike)."""
        producer = Producer(producer_config(self._bootstrap))
        nacker = Nacker(producer, CONTROL, subscription="shared")
        seen: set[tuple[int, int]] = set()
        try:
            while not self._stop.wait(0.5):
                try:
                    found = read_all(self._bootstrap, f"{TOPIC}.shared")
                except KafkaException:
                    # The broker is restarting (Apache Kafka's restart refuses connections for
                    # seconds): an application rides it out and reads again, and so does this one.
                    continue
                for m in found:
                    if (m.partition(), m.offset()) in seen:
                        continue
                    seen.add((m.partition(), m.offset()))
                    d = read_delivery(dict(m.headers() or []))
                    origin = (d.partition, d.offset)
                    if d.redelivery_count or origin in self.sent:
                        continue
                    if self._rng.random() < self._fraction:
                        delay = self._rng.randint(1_000, 5_000)
                        nacker.nack(m, delay)
                        self.sent[origin] = now_ms() + delay
                nacker.flush(10)
        finally:
            producer.flush(10)


class Cancels(Background):
    """Cancels of a fixed share of the records and of every held one (`Plan.held`), each sent at a
    random time between the record's production and a window later: some before it falls due, some
    after (too late)."""

    def __init__(
        self, bootstrap: str, plan: Plan, produced: list[float], positions: Positions, topic: str = TOPIC
    ) -> None:
        super().__init__()
        self._bootstrap, self._rng, self._window_s = bootstrap, random.Random(plan.seed + 2), plan.window_s
        self._topic = topic
        self._plan, self._produced, self._positions = plan, produced, positions
        self.sent: dict[str, tuple[int, int]] = {}
        """Command id -> (origin partition, origin offset)."""
        self._produced_all = threading.Event()

    def start(self) -> Cancels:
        if self._plan.cancel_fraction > 0:
            self._thread.start()
        return self

    def _loop(self) -> None:
        producer = Producer(producer_config(self._bootstrap))
        due: list[tuple[float, int]] = []
        seen = 0
        try:
            while not self._stop.wait(0.05):
                if self._produced_all.is_set() and not due and seen == len(self._produced):
                    return  # every record produced, every cancel chosen sent
                for i in range(seen, len(self._produced)):
                    if self._rng.random() < self._plan.cancel_fraction or self._plan.held(i):
                        due.append((self._produced[i] + self._rng.uniform(0, self._window_s), i))
                seen = len(self._produced)
                due.sort()
                while due and due[0][0] <= time.monotonic() and due[0][1] in self._positions:
                    _, i = due.pop(0)
                    partition, offset = self._positions[i]  # the sidecar's own records shift offsets
                    command = {"v": 1, "type": "cancel", "topic": self._topic, "partition": partition,
                               "offset": offset, "id": f"c{i}"}  # fmt: skip
                    key = f"{self._topic}/{partition}/{offset}".encode()
                    producer.produce(CONTROL, json.dumps(command).encode(), key=key)
                    self.sent[f"c{i}"] = (partition, offset)
                producer.poll(0)
        finally:
            producer.flush(10)

    def finish(self) -> None:
        """Every record is produced: send the cancels still to come (up to a window), then end."""
        self._produced_all.set()
        if self._thread.is_alive():
            self._thread.join(self._window_s + 30)


def read_all(bootstrap: str, topic: str, committed_only: bool = True) -> list[Any]:
    """Every record of the topic up to its high watermark now."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"audit-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "enable.partition.eof": True, **WHOLE_PARTITION_FETCH,
                         "isolation.level": "read_committed" if committed_only else "read_uncommitted"})  # fmt: skip
    try:
        ends = {}
        for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        out: list[Any] = []
        deadline = time.monotonic() + 300
        while ends and time.monotonic() < deadline:
            for m in consumer.consume(10_000, 0.2):
                if m.error() is not None:  # end of partition: transaction markers may close it
                    if m.partition() in ends and m.offset() >= ends[m.partition()]:
                        del ends[m.partition()]
                    continue
                if m.offset() < ends.get(m.partition(), -1):
                    out.append(m)
                if m.offset() + 1 >= ends.get(m.partition(), 0):
                    ends.pop(m.partition(), None)
        if ends:
            raise RuntimeError(f"{topic}: partitions {sorted(ends)} not read to their end in 300 s")
        return out
    finally:
        consumer.close()


def audit(
    bootstrap: str,
    records: int,
    nacked: dict[tuple[int, int], int],
    cancels: dict[str, tuple[int, int]] | None = None,
    positions: Positions | None = None,
) -> Audit:
    """Count copies per (origin, redelivery count) as an outbound consumer sees them (read_committed)."""
    result = Audit(nacks_sent=len(nacked), cancels_sent=len(cancels or {}))
    # Record i went to partition i % PARTITIONS; its offset is the producer's delivery report's, since
    # cancels' requests and facts take offsets of the inbound partitions too.
    if positions is not None and len(positions) == records:
        produced = set(positions.values())
    else:
        produced = {(i % PARTITIONS, i // PARTITIONS) for i in range(records)}
    cancelled: set[tuple[int, int]] = set()
    nack_cancelled: set[tuple[int, int]] = set()
    """Nacked records whose cancel took the pending redelivery back (the outcome's `nacks`)."""
    if cancels:
        answers: Counter[str] = Counter()
        for m in read_all(bootstrap, f"{CONTROL}.outcomes"):
            data = json.loads(m.value())
            answers[data.get("id") or ""] += 1
            if data.get("outcome") == "cancelled" and data.get("id") in cancels:
                took_nack = "shared" in (data.get("nacks") or [])
                (nack_cancelled if took_nack else cancelled).add(cancels[data["id"]])
        result.cancels_not_answered_once = sum(1 for command_id in cancels if answers[command_id] != 1)
        result.cancelled = len(cancelled)
    for sub in SUBSCRIPTIONS:
        copies: Counter[tuple[int, int, int]] = Counter()
        # (origin partition, origin offset) -> (outbound partition, offset) of its first copy.
        placed: dict[tuple[int, int], tuple[int, int]] = {}
        early = 0
        for m in read_all(bootstrap, f"{TOPIC}.{sub}"):
            d = read_delivery(dict(m.headers() or []))
            key = (d.partition, d.offset, d.redelivery_count)
            copies[key] += 1
            early += m.timestamp()[1] < d.deliver_at
            if key[2] == 0:
                origin, position = key[:2], (m.partition(), m.offset())
                placed[origin] = min(placed.get(origin, position), position)
        if sub in ORDERED:
            result.wrong_partition[sub], result.out_of_order[sub] = order_counts(placed)
        result.redelivered[sub] = sum(1 for _, _, n in copies if n > 0)
        firsts = {(p, o) for p, o, n in copies if n == 0}
        gone = cancelled if sub == "shared" else set()  # a cancel reaches the delayed subscription only
        result.lost[sub] = len(produced - gone - firsts)
        if sub == "shared":
            result.cancelled_delivered = len(firsts & cancelled)
        result.duplicated[sub] = sum(n - 1 for n in copies.values() if n > 1)
        result.early[sub] = early
        again = {(p, o) for p, o, n in copies if n > 0}
        if sub == "shared":
            result.nacks_redelivered = len(again & set(nacked))
            result.nacks_cancelled = len((set(nacked) & nack_cancelled) - again)
            result.nacks_missing_or_early = len(set(nacked) - again - nack_cancelled)
            result.redeliveries_unasked = len(again - set(nacked))
        else:
            result.redeliveries_unasked += len(again)
    return result


def order_counts(placed: dict[tuple[int, int], tuple[int, int]]) -> tuple[int, int]:
    """(wrong partition, out of order) among first copies, as the Spark audit counts them.

    Wrong partition: on another outbound partition than the inbound one (the topics have as many
    partitions). Out of order: per inbound partition and outbound partition, in inbound offset
    order, a first copy at a lower outbound offset than its predecessor's (one per displaced record).
    """
    wrong = sum(1 for (partition, _), (out_partition, _) in placed.items() if out_partition != partition)
    lanes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (partition, offset), (out_partition, out_offset) in placed.items():
        lanes.setdefault((partition, out_partition), []).append((offset, out_offset))
    disorder = 0
    for lane in lanes.values():
        lane.sort()
        disorder += sum(1 for (_, before), (_, after) in itertools.pairwise(lane) if after < before)
    return wrong, disorder


Positions = dict[int, tuple[int, int]]
"""Record number -> (partition, offset), from the producer's delivery reports."""


def producer_config(bootstrap: str) -> dict[str, Any]:
    """Idempotent, as users' producers should be: on three nodes a plain producer wrote 3 cancel
    commands twice when a leader moved (each copy was answered, so their ids were answered twice)."""
    return {"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True}


def produce(bootstrap: str, plan: Plan, produced: list[float], positions: Positions, held: list[float]) -> None:
    """Records spread over the first part of the run, each with deliver-after 0 to window s (held
    ones `hold_s` more, their due instants in `held`, monotonic)."""
    rng = random.Random(plan.seed)
    producer = Producer(producer_config(bootstrap))
    spread_s = plan.window_s / 2
    started = time.monotonic()
    for i in range(plan.records):
        delay_ms = rng.randrange(int(plan.window_s * 1000)) + (int(plan.hold_s * 1000) if plan.held(i) else 0)
        if plan.held(i):
            held.append(time.monotonic() + delay_ms / 1000)
        producer.produce(TOPIC, f"v{i}".encode(), headers=[("deliver-after", str(delay_ms))], partition=i % PARTITIONS,
                         on_delivery=lambda err, m, i=i: positions.__setitem__(i, (m.partition(), m.offset()))
                         if err is None else None)  # fmt: skip
        produced.append(time.monotonic())
        if i % 500 == 0:
            producer.poll(0)
            time.sleep(max(started + spread_s * i / plan.records - time.monotonic(), 0))
    assert producer.flush(60) == 0, "records not acknowledged"


def visible(bootstrap: str, records: int, nacks: Nacks, cancels: Cancels) -> bool:
    counts = {sub: len(read_all(bootstrap, f"{TOPIC}.{sub}")) for sub in SUBSCRIPTIONS}
    cancelled = 0
    if cancels.sent:
        answers = [json.loads(m.value()) for m in read_all(bootstrap, f"{CONTROL}.outcomes")]
        if sum(1 for a in answers if a.get("id") in cancels.sent) < len(cancels.sent):
            return False  # every cancel answered first: until then, what `shared` should hold is not known
        cancelled = sum(1 for a in answers if a.get("id") in cancels.sent and a.get("outcome") == "cancelled")
    return counts["excl"] >= records and counts["shared"] >= records - cancelled + len(nacks.sent)


def run(
    plan: Plan, workdir: Path, log: Any = print, spark: SparkSession | None = None, command: str = "bench.chaos"
) -> Outcome:
    """The chaos run; with `plan.spark_audit`, the Spark audit judges it too (in `spark` when given,
    a session shared across runs, else in a `delay-sidecar audit` process of its own). `command`
    is named in the outcome's dated header."""
    started = time.monotonic()
    rng = random.Random(plan.seed)
    outcome = Outcome(plan, Audit())
    broker = bench_broker(workdir / "broker")
    bootstrap = broker.start()
    outcome.dated = dated_lines(broker, command)
    policies = workdir / "policies.yaml"
    policies.write_text(f"topics:\n  {TOPIC}:\n    subscriptions: {{shared: {{}}, excl: {{type: exclusive}}}}\n")
    create_topic(bootstrap, TOPIC, PARTITIONS)
    for sub in SUBSCRIPTIONS:
        create_topic(bootstrap, f"{TOPIC}.{sub}", PARTITIONS)
    sidecar = Sidecar(workdir, bootstrap, policies, plan, "a")
    others: list[Sidecar] = []
    nacks = Nacks(bootstrap, plan.seed, plan.nack_fraction).start()
    produced: list[float] = []
    positions: Positions = {}
    held: list[float] = []
    cancels = Cancels(bootstrap, plan, produced, positions).start()
    try:
        sidecar.start()
        producer = threading.Thread(target=produce, args=(bootstrap, plan, produced, positions, held), daemon=True)
        producer.start()
        # The faults, in a random order, spread over the window while records fall due.
        faults = ["kill"] * plan.kills
        if plan.zombie:
            faults.insert(rng.randrange(len(faults) + 1), "zombie")
        if plan.broker_restart:
            faults.insert(rng.randrange(len(faults) + 1), "broker")
        if plan.state_loss:
            faults.insert(rng.randrange(len(faults) + 1), "state")
        gap_s = plan.window_s * 1.1 / max(len(faults), 1)
        for fault in faults:
            time.sleep(rng.uniform(0.3, 1.7) * gap_s)
            log(f"[chaos] {fault} at {time.monotonic() - started:.1f}s")
            if fault in ("kill", "state"):
                sidecar.kill()
                outcome.kills += 1
                if fault == "state":
                    shutil.rmtree(sidecar.state, ignore_errors=True)
                    outcome.state_dirs_deleted += 1
                sidecar.start()
                outcome.restarts += 1
            elif fault == "broker":
                broker.stop()
                time.sleep(2)
                broker.start()
                outcome.broker_restarts += 1
            else:
                successor = Sidecar(workdir, bootstrap, policies, plan, "b")
                outcome.zombie = zombie(sidecar, successor, partial(sidecar.claimed, bootstrap))
                others.append(sidecar)
                sidecar = successor
        faults_over = time.monotonic()
        producer.join(600)
        cancels.finish()
        # The held records fall due now, after every fault: their cancels must have held through them.
        while held and time.monotonic() < max(held) + 4 * plan.commit_interval_ms / 1000:
            time.sleep(0.5)
        outcome.held_due = sum(faults_over < at < time.monotonic() for at in held)
        deadline = time.monotonic() + 300 + plan.records / 1_000
        # The nacker goes on nacking what it sees: stopped once every record is visible, the nacks
        # are final, and the second wait covers the redeliveries of the last ones (due 1 to 5 s on).
        for wait in ("records", "redeliveries"):
            while not visible(bootstrap, plan.records, nacks, cancels):
                if time.monotonic() > deadline:
                    outcome.notes.append(f"not every record became visible before the deadline ({wait})")
                    break
                time.sleep(2)
            nacks.stop()
        time.sleep(plan.commit_interval_ms / 1000 * 4)  # extras, if any, would come now
        cancels.stop()
        if nacks.error is not None:
            outcome.notes.append(f"nacker failed: {nacks.error!r}")
        if cancels.error is not None:
            outcome.notes.append(f"canceller failed: {cancels.error!r}")
        if (code := sidecar.stop()) != 0:
            outcome.notes.append(f"the sidecar did not exit 0 (exit {code}); see {sidecar.log}")
        outcome.audit = audit(bootstrap, plan.records, nacks.sent, cancels.sent, positions)
        uncommitted = {s: read_all(bootstrap, f"{TOPIC}.{s}", committed_only=False) for s in SUBSCRIPTIONS}
        for sub, found in uncommitted.items():
            firsts = [read_delivery(dict(m.headers() or [])) for m in found]
            outcome.audit.written[sub] = len({(d.partition, d.offset) for d in firsts if not d.redelivery_count})
        written = sum(len(found) for found in uncommitted.values())
        outcome.aborted_records = written - sum(len(read_all(bootstrap, f"{TOPIC}.{s}")) for s in SUBSCRIPTIONS)
        if plan.spark_audit:
            outcome.spark = spark_audit(bootstrap, policies, workdir, spark)
            outcome.spark.disagreements = disagreements(outcome.audit, plan.records, outcome.spark)
    finally:
        nacks.stop()
        cancels.stop()
        for s in [sidecar, *others]:
            s.kill()
        broker.stop()
    outcome.wall_s = time.monotonic() - started
    return outcome


def spark_audit(bootstrap: str, policies: Path, workdir: Path, spark: SparkSession | None = None) -> SparkAudit:
    """`delay-sidecar audit` (read_committed by default) over the run: its exit code and counts.

    Without `spark`, in a process of its own, as an operator runs it. With it, the same job in this
    process (spark.audit_job.run_job), which spares a test a JVM start per run. Either way the
    counts come from the report.json it wrote, not from its printed table.
    """
    output = workdir / "audit"
    started = time.monotonic()
    if spark is None:
        argv = [sys.executable, "-m", "sidecar", "audit", "--bootstrap-servers", bootstrap,
                "--policies", str(policies), "--output-dir", str(output), "--control-topic", CONTROL]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, check=False, cwd=ROOT)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    else:
        from spark.audit_job import run_job  # noqa: PLC0415 (PySpark only when the audit runs)
        from spark.settings import AuditSettings  # noqa: PLC0415

        settings = AuditSettings(
            bootstrap_servers=bootstrap, policies=policies, output_dir=output, control_topic=CONTROL
        )
        out, err = io.StringIO(), io.StringIO()
        watchdog = _stacks_after(spark, AUDIT_STACKS_AFTER_S, output / "jvm-stacks.txt")
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = run_job(settings, spark)
        finally:
            watchdog.cancel()
        stdout, stderr = out.getvalue(), err.getvalue()
    # Its table and verdict are on stdout; stderr (Spark's chatter) matters only when it could not run.
    printed = stdout if code in (0, 1) else stdout + stderr
    lines = [line for line in printed.splitlines() if line.strip()][-25:]
    result = SparkAudit(code, round(time.monotonic() - started, 1), output="\n".join(lines))
    report = output / "report.json"
    if code in (0, 1) and report.is_file():  # 2: it could not run, and wrote no report
        data = result.report = json.loads(report.read_text())
        result.subscriptions = {s["subscription"]: s for s in data["subscriptions"] if s["topic"] == TOPIC}
        result.anomaly_counts = data["anomaly_counts"]
    return result


def _stacks_after(spark: SparkSession, after_s: float, path: Path) -> threading.Timer:
    """Write the Spark JVM's thread stacks to `path` if the audit still runs after `after_s`: a CI
    run's audit hung in its analysis until pytest's timeout, with nothing to say where."""
    pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())  # type: ignore[union-attr]

    def dump() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as out:
            subprocess.run(["jstack", str(pid)], stdout=out, stderr=subprocess.STDOUT, timeout=60, check=False)

    timer = threading.Timer(after_s, dump)
    timer.daemon = True
    timer.start()
    return timer


def disagreements(audit: Audit, records: int, spark: SparkAudit) -> list[str]:
    """Each count where the Spark audit and the bench's own counter differ, in words.

    Both read the same topics read_committed after the run, so they must agree exactly. A record
    the bench produced but the audit did not find on the inbound topic counts as lost for the bench
    and is named as such here.
    """
    if spark.exit_code not in (0, 1) or not spark.subscriptions:
        return [f"the Spark audit gave no counts (exit {spark.exit_code})"]
    found: list[str] = []
    for sub in SUBSCRIPTIONS:
        s = spark.subscriptions.get(sub)
        if s is None:
            found.append(f"{sub}: not in the Spark audit's report")
            continue
        unseen = records - s["inbound"]
        undelivered = unseen + s["rejected"] + s["pending"] + s["missing"]
        why = f"missing {s['missing']}, pending {s['pending']}, rejected {s['rejected']}, not inbound {unseen}"
        pairs: list[tuple[str, int, int, str]] = [
            ("lost", audit.lost.get(sub, 0), undelivered, f" ({why})"),
            ("duplicated", audit.duplicated.get(sub, 0), s["duplicates"], ""),
            ("early", audit.early.get(sub, 0), s["early"], ""),
            ("redelivered", audit.redelivered.get(sub, 0), s["redelivered"], ""),
            ("out of order", audit.out_of_order.get(sub, 0), s["out_of_order"], ""),
            ("wrong partition", audit.wrong_partition.get(sub, 0), s["wrong_partition"], ""),
        ]
        if sub == "shared":
            pairs += [
                ("cancelled", audit.cancelled, s.get("cancelled", 0), ""),
                ("delivered after cancel", audit.cancelled_delivered, s.get("delivered_after_cancel", 0), ""),
                ("nacks", audit.nacks_sent, s["nacks"], ""),
                ("nacks not redelivered", audit.nacks_missing_or_early, s["nacks_missing"] + s["nacks_pending"], ""),
            ]
        found += [f"{name} ({sub}): bench {mine}, Spark audit {theirs}{how}" for name, mine, theirs, how in pairs
                  if mine != theirs]  # fmt: skip
    return found


WENT_ON = "**went on**"
"""The woken zombie's engine did not stop: what a zombie must never do."""


def zombie(first: Sidecar, second: Sidecar, ready: Callable[[], bool] = lambda: True) -> str:
    """SIGSTOP `first`, start `second` with its instance id, wake `first`: how the woken one stopped,
    `fenced` or the error its engine failed with first, or WENT_ON. `first` is stopped once `ready`
    holds (up to 60 s), in the chaos run once it has claimed its partitions (`Sidecar.claimed`).

    Fenced is the usual end. A zombie stopped long enough can fail first on a request that timed out
    in its queue while it slept (CI, under load: `_TIMED_OUT_QUEUE` reading the group's commits after
    52 s stopped); its engine ended before it delivered or committed anything, which is what matters
    here, and the counts check that it repeated nothing."""
    # Only one that has claimed its partitions is a zombie to fence. One stopped before that (in
    # the chaos test, 1.7 s after a kill -9 and restart, before it had fenced the killed process)
    # left the killed process's open transaction, with offsets no commit named yet, to the broker:
    # the successor waited for its timeout (transaction.timeout.ms; docs/operations/faults.md).
    deadline = time.monotonic() + 60
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.2)
    first.signal(signal.SIGSTOP)
    second.start()
    deadline = time.monotonic() + 60
    while "partitions assigned" not in second.log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # the successor delivers for a while
    before = len(first.log.read_text(errors="replace"))
    first.signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "engine failed" not in first.log.read_text(errors="replace")[before:]:
        time.sleep(0.1)
    first.kill()  # before its next engine fences the successor in turn
    # Its engine stopped, and the producer's or the group's word for why, in the sidecar's or
    # librdkafka's lines. Not "fenced" alone: a new engine logs the producers it fences itself.
    woken = first.log.read_text(errors="replace")[before:]
    failed = next((line for line in woken.splitlines() if "engine failed" in line), None)
    if failed is None:
        return WENT_ON
    if "fenced" in woken:
        return "fenced"
    error = re.search(r"error=(.{0,80})", failed)
    return f"failed first: {error.group(1) if error else failed[-80:]}"


def table(outcome: Outcome, command: str) -> str:
    a, plan = outcome.audit, outcome.plan
    rows = [
        ("command", f"`{command}`"),
        ("seed", str(plan.seed)),
        (f"records (deliver-after 0 to {plan.window_s:.0f} s), subscriptions", f"{plan.records:,}, shared + exclusive"),
        ("nacks sent / redelivered / cancelled", f"{a.nacks_sent:,} / {a.nacks_redelivered:,} / {a.nacks_cancelled:,}"),
        ("cancels sent / answered cancelled", f"{a.cancels_sent:,} / {a.cancelled:,}"),
        ("SIGKILLs / restarts on the state dir", f"{outcome.kills} / {outcome.restarts}"),
        ("state dirs deleted", str(outcome.state_dirs_deleted)),
        ("broker restarts", str(outcome.broker_restarts)),
        ("woken zombie", outcome.zombie or "no zombie"),
        ("held (cancelled) records due after the faults", str(outcome.held_due)),
        ("records written in aborted transactions (invisible to read_committed)", f"{outcome.aborted_records:,}"),
        ("lost (shared / exclusive)", f"{a.lost.get('shared', 0)} / {a.lost.get('excl', 0)}"),
        (
            "written at least once, read_uncommitted (shared / exclusive)",
            f"{a.written.get('shared', 0):,} / {a.written.get('excl', 0):,}",
        ),
        ("duplicated (shared / exclusive)", f"{a.duplicated.get('shared', 0)} / {a.duplicated.get('excl', 0)}"),
        ("early (shared / exclusive)", f"{a.early.get('shared', 0)} / {a.early.get('excl', 0)}"),
        (
            "exclusive: out of inbound order / on another partition",
            f"{a.out_of_order.get('excl', 0)} / {a.wrong_partition.get('excl', 0)}",
        ),
        (
            "nacks not redelivered / redeliveries not asked for",
            f"{a.nacks_missing_or_early} / {a.redeliveries_unasked}",
        ),
        (
            "cancelled yet delivered / cancels not answered exactly once",
            f"{a.cancelled_delivered} / {a.cancels_not_answered_once}",
        ),
        ("anomalies in all", str(a.anomalies)),
    ]
    spark = outcome.spark
    rows += spark_rows(spark) if spark is not None else []
    rows.append(("wall time", f"{outcome.wall_s:.0f} s"))
    lines = ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]
    lines += [f"\nnote: {n}" for n in outcome.notes]
    if spark is not None:
        if spark.exit_code != 0:
            lines.append(f"\nSPARK AUDIT FAILED: exit {spark.exit_code} (0 passed, 1 anomalies, 2 could not run)")
        lines += [f"\nSPARK AUDIT DISAGREES: {d}" for d in spark.disagreements]
        lines += ["\nSpark audit's output (last lines):\n```", spark.output, "```"]
    return "\n".join(lines)


def spark_rows(spark: SparkAudit) -> list[tuple[str, str]]:
    """The Spark audit's rows of a run's table: its verdict, its agreement, its time."""
    verdict = {0: "PASS", 1: "FAIL (anomalies)"}.get(spark.exit_code, "**could not run**")
    return [
        ("Spark audit (`delay-sidecar audit`, read_committed)", f"exit {spark.exit_code}, {verdict}"),
        ("Spark audit's counts equal the bench's", "yes" if not spark.disagreements else "**no**"),
        ("Spark audit's wall time", f"{spark.seconds:.0f} s"),
    ]


class Passing(Protocol):
    @property
    def passed(self) -> bool: ...


Finished = TypeVar("Finished", bound=Passing)


def in_workdir(prefix: str, go: Callable[[Path], Finished]) -> Finished:
    """`go` in a new temporary dir, removed once its outcome passed. Otherwise, or when it raised,
    the dir is kept and named: the sidecars' logs and state dirs, and the broker's data, are the
    evidence."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    outcome: Finished | None = None
    try:
        outcome = go(workdir)
    finally:
        if outcome is not None and outcome.passed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir} (the sidecars' logs and state dirs, the broker's data)", file=sys.stderr)
    return outcome


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--nack-fraction", type=float, default=0.05, help="share of `shared` records nacked")
    parser.add_argument("--cancel-fraction", type=float, default=0.03, help="share of records cancelled")
    parser.add_argument("--no-broker-restart", action="store_true")
    parser.add_argument("--no-state-loss", action="store_true")
    parser.add_argument("--no-zombie", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the outcome as JSON")
    parser.add_argument("--spark-audit", action="store_true", help="also run delay-sidecar audit over the run")
    args = parser.parse_args(argv)
    command = command_line("bench.chaos", argv)
    plan = Plan(args.records, args.kills, args.window_s, args.seed, not args.no_broker_restart,
                not args.no_state_loss, not args.no_zombie, nack_fraction=args.nack_fraction,
                cancel_fraction=args.cancel_fraction,
                spark_audit=args.spark_audit)  # fmt: skip
    outcome = in_workdir("bench-chaos-", lambda workdir: run(plan, workdir, log=to_stderr, command=command))
    print(outcome.dated + "\n")
    print(table(outcome, command))
    if args.json:
        spark = asdict(outcome.spark) if outcome.spark is not None else None
        args.json.write_text(json.dumps({"plan": plan.__dict__, "audit": outcome.audit.__dict__, "spark_audit": spark,
                                         "kills": outcome.kills, "wall_s": outcome.wall_s}, indent=2))  # fmt: skip
    if outcome.spark is not None and not outcome.spark.passed:
        print("FAIL: the Spark audit failed or disagrees with the bench's counts (above)", file=sys.stderr)
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main())
