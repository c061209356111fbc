"""The chaos run of issue 14: exactly-once delivery through kill -9, a lost state dir, a broker
restart and a zombie, with nacks, checked by counting every record of every subscription.

Usage: .venv/bin/python -m bench.chaos [--records 20000] [--kills 20] [--seed 14] [--no-broker-restart]
       [--no-state-loss] [--no-zombie] [--window-s 30]

A broker of its own (noida-db), one inbound topic with two subscriptions: `shared` (shared) and
`excl` (exclusive, delivered at publish time). Records carry deliver-after 0 to `window` seconds. A
consumer of `shared` (read_committed) nacks 5% of what it receives (--nack-fraction), once each, 1 to 5 s later. While
records fall due, the sidecar (exactly-once) is killed with SIGKILL and started again on its state
dir `--kills` times; once the state dir is deleted before the restart; the broker is stopped and
started once; and once the sidecar is stopped with SIGSTOP, a second sidecar with the same instance
id takes its place, and the first is woken (SIGCONT): it must be fenced. At the end every outbound
topic is read to its high watermark, read_committed, and counted per record (`audit`).

The test suite runs a short version (tests/test_chaos.py); the full one writes docs/reliability.md's
table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.probe import create_topic, now_ms
from bench.procs import Child
from sidecar.broker.embedded import EmbeddedBroker, free_port
from sidecar.client import Nacker
from sidecar.outbound.records import DELIVER_AT, ORIGIN_OFFSET, ORIGIN_PARTITION, REDELIVERY_COUNT

ROOT = Path(__file__).resolve().parents[1]
TOPIC, PARTITIONS, CONTROL = "chaos", 2, "delay-sidecar.control"
# noida-db lists aborted transactions that ended before a fetch's offset, and librdkafka then drops
# the later records of that producer (tests/broker/test_transactions.py): readers here start at
# offset 0 and take each partition in one fetch, so they see every abort marker in order.
WHOLE_PARTITION_FETCH = {
    "max.partition.fetch.bytes": 256 * 1024 * 1024,
    "fetch.max.bytes": 512 * 1024 * 1024,
    "receive.message.max.bytes": 600 * 1024 * 1024,
}
SUBSCRIPTIONS = ("shared", "excl")


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
    spark_audit: bool = False


@dataclass
class Audit:
    """Per subscription: records lost, extra copies, early ones; nacks sent, redelivered, bad."""

    lost: dict[str, int] = field(default_factory=dict)
    duplicated: dict[str, int] = field(default_factory=dict)
    early: dict[str, int] = field(default_factory=dict)
    nacks_sent: int = 0
    nacks_redelivered: int = 0
    nacks_missing_or_early: int = 0
    redeliveries_unasked: int = 0
    written: dict[str, int] = field(default_factory=dict)
    """Distinct records written at least once, committed or not (read_uncommitted): a record lost
    read_committed but written was lost by the reader, not by the sidecar."""

    @property
    def anomalies(self) -> int:
        return (
            sum(self.lost.values())
            + sum(self.duplicated.values())
            + sum(self.early.values())
            + self.nacks_missing_or_early
            + self.redeliveries_unasked
        )


@dataclass
class Outcome:
    plan: Plan
    audit: Audit
    kills: int = 0
    restarts: int = 0
    broker_restarts: int = 0
    state_dirs_deleted: int = 0
    zombie_fenced: bool | None = None
    aborted_records: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    spark: str = ""
    """The Spark audit's exit code and summary, when it ran."""


class Sidecar:
    """The sidecar under test: one process at a time (two during the zombie), started on demand."""

    def __init__(self, workdir: Path, bootstrap: str, policies: Path, plan: Plan, name: str) -> None:
        self.workdir, self.state = workdir, workdir / f"state-{name}"
        self.log = workdir / f"sidecar-{name}.log"
        self.args = [sys.executable, "-m", "sidecar", "run", "--bootstrap-servers", bootstrap,
                     "--policies", str(policies), "--state-dir", str(self.state), "--metrics-port", "0",
                     "--group-id", "chaos", "--instance-id", "chaos-member", "--processing-guarantee",
                     "exactly-once", "--commit-interval-ms", str(plan.commit_interval_ms)]  # fmt: skip
        self.child: Child | None = None
        # Each sidecar as if on a host of its own: the zombie's successor shares its instance id,
        # which the host-wide identity lock would refuse on one host (sidecar/identity.py).
        self.host = workdir / f"host-{name}"
        self.host.mkdir(exist_ok=True)

    def start(self) -> None:
        self.child = Child(self.args, self.log, env={"TMPDIR": str(self.host)})

    def kill(self) -> None:
        if self.child is not None and self.child.alive():
            self.child.process.send_signal(signal.SIGKILL)
            self.child.process.wait(30)

    def signal(self, signum: int) -> None:
        assert self.child is not None
        os.kill(self.child.pid, signum)

    def stop(self) -> int:
        return self.child.stop() if self.child is not None else 0


class Nacks:
    """A read_committed consumer of `shared` that nacks a fixed 5% of the records, once each."""

    def __init__(self, bootstrap: str, seed: int, fraction: float) -> None:
        self._bootstrap, self._rng, self._fraction = bootstrap, random.Random(seed + 1), fraction
        self.sent: dict[tuple[int, int], int] = {}
        """(origin partition, origin offset) -> the earliest instant it may come back (ms)."""
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Nacks:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # reported in the outcome
            self.error = e

    def _loop(self) -> None:
        """A long-lived consumer would stop seeing the sidecar's records after its first aborted
        transaction on noida-db (see WHOLE_PARTITION_FETCH), so the topic is read again from the
        start every half second, and only records not seen before are considered."""
        producer = Producer({"bootstrap.servers": self._bootstrap, "linger.ms": 5})
        nacker = Nacker(producer, CONTROL, subscription="shared")
        seen: set[tuple[int, int]] = set()
        try:
            while not self._stop.wait(0.5):
                for m in read_all(self._bootstrap, f"{TOPIC}.shared"):
                    headers = dict(m.headers() or [])
                    if (m.partition(), m.offset()) in seen:
                        continue
                    seen.add((m.partition(), m.offset()))
                    origin = (int(headers[ORIGIN_PARTITION]), int(headers[ORIGIN_OFFSET]))
                    if int(headers.get(REDELIVERY_COUNT, b"0")) or origin in self.sent:
                        continue
                    if self._rng.random() < self._fraction:
                        delay = self._rng.randint(1_000, 5_000)
                        nacker.nack(m, delay)
                        self.sent[origin] = now_ms() + delay
                nacker.flush(10)
        finally:
            producer.flush(10)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def read_all(bootstrap: str, topic: str, committed_only: bool = True) -> list[Any]:
    """Every record of the topic up to its high watermark now."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"audit-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "enable.partition.eof": True, **WHOLE_PARTITION_FETCH,
                         "isolation.level": "read_committed" if committed_only else "read_uncommitted"})  # fmt: skip
    try:
        ends = {}
        for p in range(PARTITIONS):
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


def audit(bootstrap: str, records: int, nacked: dict[tuple[int, int], int]) -> Audit:
    """Count copies per (origin, redelivery count) as an outbound consumer sees them (read_committed)."""
    result = Audit(nacks_sent=len(nacked))
    # Record i went to partition i % PARTITIONS, so each partition holds a run of offsets from 0.
    produced = {(i % PARTITIONS, i // PARTITIONS) for i in range(records)}
    for sub in SUBSCRIPTIONS:
        copies: Counter[tuple[int, int, int]] = Counter()
        early = 0
        for m in read_all(bootstrap, f"{TOPIC}.{sub}"):
            headers = dict(m.headers() or [])
            key = (
                int(headers[ORIGIN_PARTITION]),
                int(headers[ORIGIN_OFFSET]),
                int(headers.get(REDELIVERY_COUNT, b"0")),
            )
            copies[key] += 1
            early += m.timestamp()[1] < int(headers[DELIVER_AT])
        firsts = {(p, o) for p, o, n in copies if n == 0}
        result.lost[sub] = len(produced - firsts)
        result.duplicated[sub] = sum(n - 1 for n in copies.values() if n > 1)
        result.early[sub] = early
        again = {(p, o) for p, o, n in copies if n > 0}
        if sub == "shared":
            result.nacks_redelivered = len(again & set(nacked))
            result.nacks_missing_or_early = len(set(nacked) - again)
            result.redeliveries_unasked = len(again - set(nacked))
        else:
            result.redeliveries_unasked += len(again)
    return result


def produce(bootstrap: str, plan: Plan) -> None:
    """Records spread over the first part of the run, each with deliver-after 0 to window s."""
    rng = random.Random(plan.seed)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    spread_s = plan.window_s / 2
    started = time.monotonic()
    for i in range(plan.records):
        delay_ms = rng.randrange(int(plan.window_s * 1000))
        producer.produce(TOPIC, f"v{i}".encode(), headers=[("deliver-after", str(delay_ms))], partition=i % PARTITIONS)
        if i % 500 == 0:
            producer.poll(0)
            time.sleep(max(started + spread_s * i / plan.records - time.monotonic(), 0))
    assert producer.flush(60) == 0, "records not acknowledged"


def visible(bootstrap: str, records: int, nacks: Nacks) -> bool:
    counts = {sub: len(read_all(bootstrap, f"{TOPIC}.{sub}")) for sub in SUBSCRIPTIONS}
    return counts["excl"] >= records and counts["shared"] >= records + len(nacks.sent)


def run(plan: Plan, workdir: Path, log: Any = print) -> Outcome:
    started = time.monotonic()
    rng = random.Random(plan.seed)
    outcome = Outcome(plan, Audit())
    broker = EmbeddedBroker(workdir / "broker", port=free_port())
    bootstrap = broker.start()
    policies = workdir / "policies.yaml"
    policies.write_text(f"topics:\n  {TOPIC}:\n    subscriptions: {{shared: {{}}, excl: {{type: exclusive}}}}\n")
    create_topic(bootstrap, TOPIC, PARTITIONS)
    for sub in SUBSCRIPTIONS:
        create_topic(bootstrap, f"{TOPIC}.{sub}", PARTITIONS)
    sidecar = Sidecar(workdir, bootstrap, policies, plan, "a")
    others: list[Sidecar] = []
    nacks = Nacks(bootstrap, plan.seed, plan.nack_fraction).start()
    try:
        sidecar.start()
        producer = threading.Thread(target=produce, args=(bootstrap, plan), daemon=True)
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
                outcome.zombie_fenced = zombie(sidecar, successor := Sidecar(workdir, bootstrap, policies, plan, "b"))
                others.append(sidecar)
                sidecar = successor
        producer.join(600)
        deadline = time.monotonic() + 300 + plan.records / 1_000
        while not visible(bootstrap, plan.records, nacks):
            if time.monotonic() > deadline:
                outcome.notes.append("not every record became visible before the deadline")
                break
            time.sleep(2)
        time.sleep(plan.commit_interval_ms / 1000 * 4)  # extras, if any, would come now
        nacks.stop()
        if nacks.error is not None:
            outcome.notes.append(f"nacker failed: {nacks.error!r}")
        if sidecar.stop() != 0:
            outcome.notes.append(f"the sidecar did not exit 0; see {sidecar.log}")
        outcome.audit = audit(bootstrap, plan.records, nacks.sent)
        uncommitted = {s: read_all(bootstrap, f"{TOPIC}.{s}", committed_only=False) for s in SUBSCRIPTIONS}
        for sub, found in uncommitted.items():
            firsts = [dict(m.headers() or []) for m in found]
            outcome.audit.written[sub] = len(
                {(h[ORIGIN_PARTITION], h[ORIGIN_OFFSET]) for h in firsts if not int(h.get(REDELIVERY_COUNT, b"0"))}
            )
        written = sum(len(found) for found in uncommitted.values())
        outcome.aborted_records = written - sum(len(read_all(bootstrap, f"{TOPIC}.{s}")) for s in SUBSCRIPTIONS)
        if plan.spark_audit:
            outcome.spark = spark_audit(bootstrap, policies, workdir)
    finally:
        nacks.stop()
        for s in [sidecar, *others]:
            s.kill()
        broker.stop()
    outcome.wall_s = time.monotonic() - started
    return outcome


def spark_audit(bootstrap: str, policies: Path, workdir: Path) -> str:
    """`delay-sidecar audit` (read_committed by default) over the run: its exit code and summary."""
    argv = [sys.executable, "-m", "sidecar", "audit", "--bootstrap-servers", bootstrap, "--policies", str(policies),
            "--output-dir", str(workdir / "audit"), "--control-topic", CONTROL]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, check=False, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.strip()][-25:]
    return f"exit {done.returncode} after {time.monotonic() - started:.0f} s\n" + "\n".join(lines)


def zombie(first: Sidecar, second: Sidecar) -> bool:
    """SIGSTOP `first`, start `second` with its instance id, wake `first`: True if it was fenced."""
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
    # The producer's or the group's word for it, in the sidecar's or librdkafka's lines.
    return "fenced" in first.log.read_text(errors="replace")[before:]


def table(outcome: Outcome, command: str) -> str:
    a, plan = outcome.audit, outcome.plan
    rows = [
        ("command", f"`{command}`"),
        ("seed", str(plan.seed)),
        (f"records (deliver-after 0 to {plan.window_s:.0f} s), subscriptions", f"{plan.records:,}, shared + exclusive"),
        ("nacks sent / redelivered", f"{a.nacks_sent:,} / {a.nacks_redelivered:,}"),
        ("SIGKILLs / restarts on the state dir", f"{outcome.kills} / {outcome.restarts}"),
        ("state dirs deleted", str(outcome.state_dirs_deleted)),
        ("broker restarts", str(outcome.broker_restarts)),
        ("zombie fenced", {None: "no zombie", True: "yes", False: "**no**"}[outcome.zombie_fenced]),
        ("records written in aborted transactions (invisible to read_committed)", f"{outcome.aborted_records:,}"),
        ("lost (shared / exclusive)", f"{a.lost.get('shared', 0)} / {a.lost.get('excl', 0)}"),
        (
            "written at least once, read_uncommitted (shared / exclusive)",
            f"{a.written.get('shared', 0):,} / {a.written.get('excl', 0):,}",
        ),
        ("duplicated (shared / exclusive)", f"{a.duplicated.get('shared', 0)} / {a.duplicated.get('excl', 0)}"),
        ("early (shared / exclusive)", f"{a.early.get('shared', 0)} / {a.early.get('excl', 0)}"),
        (
            "nacks not redelivered / redeliveries not asked for",
            f"{a.nacks_missing_or_early} / {a.redeliveries_unasked}",
        ),
        ("anomalies in all", str(a.anomalies)),
        ("wall time", f"{outcome.wall_s:.0f} s"),
    ]
    lines = ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]
    lines += [f"\nnote: {n}" for n in outcome.notes]
    if outcome.spark:
        lines += ["\nSpark audit (`delay-sidecar audit`, read_committed):\n```", outcome.spark, "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--nack-fraction", type=float, default=0.05, help="share of `shared` records nacked")
    parser.add_argument("--no-broker-restart", action="store_true")
    parser.add_argument("--no-state-loss", action="store_true")
    parser.add_argument("--no-zombie", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the outcome as JSON")
    parser.add_argument("--spark-audit", action="store_true", help="also run delay-sidecar audit over the run")
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "bench.chaos", *(sys.argv[1:] if argv is None else argv)])
    plan = Plan(args.records, args.kills, args.window_s, args.seed, not args.no_broker_restart,
                not args.no_state_loss, not args.no_zombie, nack_fraction=args.nack_fraction,
                spark_audit=args.spark_audit)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    try:
        outcome = run(plan, workdir, log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(outcome, command))
    if args.json:
        args.json.write_text(json.dumps({"plan": plan.__dict__, "audit": outcome.audit.__dict__,
                                         "kills": outcome.kills, "wall_s": outcome.wall_s}, indent=2))  # fmt: skip
    return 0 if outcome.audit.anomalies == 0 and outcome.zombie_fenced is not False and not outcome.notes else 1


if __name__ == "__main__":
    sys.exit(main())
