"""The churn run (issue 48): one fate per record while members join, leave, come back on their old
state dirs and die, and while the policy loses a topic and gets it back, gains one across a restart
and tightens a max delay; on top of the chaos run's kill -9, lost state dir, broker restart and zombie.

Usage: .venv/bin/python -m bench.churn [--guarantee exactly-once|at-least-once] [--records 20000]
       [--window-s 90] [--kills 8] [--seed 48] [--spark-audit] [--json PATH]

Three members of one group, each with a state dir and an instance id of its own (churn-0 to churn-2),
as the pods of a StatefulSet. churn-0 and churn-1 start; churn-2 joins later; churn-1 stops (SIGTERM)
and comes back later on its old state dir, after the others served its partitions; churn-0 leaves for
good. One policy file serves them all and is reloaded live: `removable` leaves the policies and
comes back, and `capped`'s max delay drops from 1 h to `--tight-s`. `late` is added while every
running member is down (a rollout: SIGTERM or kill -9, by the seed). Records go to the four topics
(`steady` has two subscriptions, the others one) for the whole window, with deliver-after 0 to
`--delay-s`; a share of `steady`'s are cancelled, racing their due instants, and every 100th is held
back to fall due `--hold-s` after the window, after every event, and is always cancelled in time
(bench/chaos.py's `Cancels`).

Each produced record must have exactly one fate, counted per copy (`count`):

- delivered once to each subscription of its topic, never early;
- dead-lettered once: TOPIC_REMOVED (removable) or EXCEEDS_MAX_DELAY (capped, a delay over `tight_s`);
- cancelled: a cancel answered `cancelled`, and delivered nowhere.

Which of the first two a removable record, or a capped one over the new max, gets depends on when a
member first read it, so either counts, once. A removable record produced once the removal was in
force, and a capped one produced once the new max was, have one allowed fate (`wrong_fate` counts the
others). At least once, a repeated copy is allowed only when its first copy was written in the
REPEAT_WINDOW_S before a fault that can end a member without a commit (kill -9, a lost state dir,
the zombie, the broker restart): contract section 4. So is, at least once, a record with two fates
near such a fault (delivered by the member that died, then cancelled or dead-lettered by the next,
which knew only the commit), and a cancel answered again. Exactly once, none of this is.

With --spark-audit, `delay-sidecar audit` judges the same topics, and its counts must equal the
bench's (`disagreements`). The suite runs a short version (tests/test_chaos.py); the full runs are
in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaException, Producer

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos import (
    WENT_ON,
    Background,
    Cancels,
    Positions,
    Sidecar,
    SparkAudit,
    in_workdir,
    producer_config,
    read_all,
    spark_audit,
    spark_rows,
    to_stderr,
)
from bench.chaos import zombie as zombie_swap
from bench.churn_fates import KEYED, PARTITIONS, SETTLE_S, TOPICS, ChurnPlan, Event, Fates, count, disagreements
from bench.probe import create_topic, group_commits
from bench.procs import bench_broker
from bench.report import command_line, dated_lines
from sidecar.dispatch.drain import holds_pending

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DRAIN_WAIT_S = 60.0
"""How long the removed topic's return waits for its drain's first dead letter."""
PENDING_WAIT_S = 60.0
"""How long the removal waits for a commit of the group that holds pending records of the topic."""
GROUP = "churn"

LOOSE_MAX = "1h"
"""`capped`'s max delay before it is tightened."""


@dataclass
class Outcome:
    plan: ChurnPlan
    fates: Fates = field(default_factory=Fates)
    events: list[Event] = field(default_factory=list)
    member_starts: int = 0
    unclean_exits: list[str] = field(default_factory=list)
    """Members that a SIGTERM did not end with exit 0, or that died by themselves."""
    zombie: str | None = None
    """How the woken zombie stopped (bench.chaos.zombie), or None: no zombie in the plan."""
    held_due: int = 0
    notes: list[str] = field(default_factory=list)
    spark: SparkAudit | None = None
    wall_s: float = 0.0
    dated: str = ""

    @property
    def passed(self) -> bool:
        """No anomaly, every member ended by the bench, the zombie stopped, and the Spark audit agreeing.
        Exactly once the audit must also pass; at least once it flags as duplicates the repeats the
        bench allowed near faults, so only its agreement counts there."""
        spark_ok = self.spark is None or (
            self.spark.passed
            if self.plan.guarantee == "exactly-once"
            else self.spark.exit_code in (0, 1) and not self.spark.disagreements
        )
        return (
            self.fates.anomalies == 0
            and not self.unclean_exits
            and self.zombie != WENT_ON
            and not self.notes
            and spark_ok
        )


def policy_text(removable: bool, late: bool, capped_max: str) -> str:
    """The one policy file of the run, as it stands."""
    lines = ["topics:"]
    for topic, subs in TOPICS.items():
        if (topic == "removable" and not removable) or (topic == "late" and not late):
            continue
        lines.append(f"  {topic}:")
        if topic == "capped":
            lines.append(f"    delayed_delivery: {{max_delivery_delay: {capped_max}}}")
        if topic == KEYED:
            lines.append("    delayed_delivery: {by_key: replace}")
        lines.append("    subscriptions: {" + ", ".join(f"{s}: {{}}" for s in subs) + "}")
    return "\n".join(lines) + "\n"


class Production(Background):
    """Records spread evenly over the window and on until the events are done, round robin over the
    topics, with what each asked for."""

    def __init__(self, bootstrap: str, plan: ChurnPlan) -> None:
        super().__init__()
        self._bootstrap, self._plan = bootstrap, plan
        self.produced: dict[str, list[float]] = {t: [] for t in TOPICS}
        """Per topic, the monotonic instant of each record's production (bench/chaos.py's Cancels)."""
        self.positions: dict[str, Positions] = {t: {} for t in TOPICS}
        self.asked: dict[tuple[str, int, int], tuple[int, int]] = {}
        """(topic, partition, offset) -> (delay asked for in ms, wall-clock ms of its production)."""
        self.held: list[float] = []
        self._pending: dict[tuple[str, int], tuple[int, int]] = {}
        self.events_done = threading.Event()

    def start(self) -> Production:
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"production not done {timeout_s:.0f} s after its window")

    def _loop(self) -> None:
        plan, rng = self._plan, random.Random(self._plan.seed)
        key_rng = random.Random(plan.seed + 11)
        keys = max(plan.records // (len(TOPICS) * 3), 1)  # about three records per key
        producer = Producer(producer_config(self._bootstrap))
        names = list(TOPICS)
        started, tail_end = time.monotonic(), None
        i = 0
        # `records` over the window, at that rate until the last event is done and `delay_s / 2` on:
        # an event that came late (a zombie waits for the group) still has records after it.
        while i < plan.records or tail_end is None or time.monotonic() < tail_end:
            if tail_end is None and self.events_done.is_set():
                tail_end = time.monotonic() + plan.delay_s / 2
            topic, j = names[i % len(names)], i // len(names)
            held = topic == "steady" and plan.held(j)
            delay_ms = rng.randrange(int(plan.delay_s * 1000))
            if held:  # due `hold_s` after the window (or after now, past it): after the events
                now = time.monotonic()
                delay_ms += int((max(started + plan.window_s, now) + plan.hold_s - now) * 1000)
                self.held.append(time.monotonic() + delay_ms / 1000)
            self._pending[(topic, j)] = (delay_ms, int(time.time() * 1000))
            key, partition = None, j % PARTITIONS
            value: bytes | None = f"{topic}-{j}".encode()
            if topic == KEYED:  # a key keeps to one partition, as a partitioner places it
                k = key_rng.randrange(keys)
                key, partition = f"key-{k}".encode(), k % PARTITIONS
                value = None if key_rng.random() < 0.05 else value
            producer.produce(topic, value, key=key, partition=partition,
                             headers=[("deliver-after", str(delay_ms))],
                             on_delivery=lambda err, m, t=topic, j=j: self._placed(err, m, t, j))  # fmt: skip
            self.produced[topic].append(time.monotonic())
            if i % 200 == 0:
                producer.poll(0)
                time.sleep(max(started + plan.window_s * i / plan.records - time.monotonic(), 0))
            i += 1
        if producer.flush(60) != 0:
            raise RuntimeError("records not acknowledged within 60 s")

    def _placed(self, err: Any, m: Any, topic: str, j: int) -> None:
        if err is None:
            self.positions[topic][j] = (m.partition(), m.offset())
            self.asked[(topic, m.partition(), m.offset())] = self._pending.pop((topic, j))


class Members:
    """The group's members by slot; each slot keeps its state dir across stops, as a pod its volume."""

    def __init__(self, workdir: Path, bootstrap: str, policies: Path, plan: ChurnPlan, outcome: Outcome) -> None:
        self._workdir, self._bootstrap, self._policies, self._plan = workdir, bootstrap, policies, plan
        self._outcome = outcome
        self.slots = [self._member(slot, f"m{slot}") for slot in range(plan.members)]
        self.running: set[int] = set()
        self.retired: list[Sidecar] = []
        self._log_at_start: dict[int, int] = {}

    def _member(self, slot: int, name: str) -> Sidecar:
        return Sidecar(self._workdir, self._bootstrap, self._policies, self._plan, name,
                       instance_id=f"churn-{slot}", group=GROUP, guarantee=self._plan.guarantee)  # fmt: skip

    def start(self, slot: int) -> None:
        log = self.slots[slot].log
        self._log_at_start[slot] = log.stat().st_size if log.exists() else 0
        self.slots[slot].start()
        self.running.add(slot)
        self._outcome.member_starts += 1

    def stop(self, slots: list[int]) -> None:
        """SIGTERM, all at once, as a rollout's or a scale-down's pods: each must exit 0."""
        members = [self.slots[s] for s in slots]
        for slot in slots:
            self._started(slot)
        with ThreadPoolExecutor(max(len(members), 1)) as pool:
            codes = list(pool.map(Sidecar.stop, members))
        for slot, member, code in zip(slots, members, codes, strict=True):
            if code != 0:
                self._outcome.unclean_exits.append(f"{member.log.name}: exit {code} after SIGTERM")
            self.running.discard(slot)

    def _started(self, slot: int) -> None:
        """Until the member's process has written its first line: a SIGTERM before the interpreter
        runs the sidecar's first line ends any program by the signal's default action (exit -15),
        and the run would count it against the sidecar. The sidecar's own share of that window is
        tested in tests/test_early_stop.py."""
        log, deadline = self.slots[slot].log, time.monotonic() + 60
        while log.stat().st_size <= self._log_at_start.get(slot, 0) and time.monotonic() < deadline:
            time.sleep(0.05)

    def alive(self, slot: int) -> bool:
        child = self.slots[slot].child
        return child is not None and child.alive()

    def kill(self, slot: int) -> None:
        member = self.slots[slot]
        if member.child is not None and not member.child.alive():
            self._outcome.unclean_exits.append(f"{member.log.name}: had exited by itself (exit {member.stop()})")
        member.kill()
        self.running.discard(slot)

    def replace(self, slot: int) -> str:
        """The zombie: `slot`'s process is stopped (SIGSTOP) and a successor with its instance id, on
        another host and state dir, takes its place; the first is woken, and must stop: how it did."""
        first, successor = self.slots[slot], self._member(slot, f"m{slot}z{len(self.retired)}")
        fenced = zombie_swap(first, successor)
        self.retired.append(first)
        self.slots[slot] = successor
        self._outcome.member_starts += 1
        return fenced

    def close(self) -> None:
        for member in [*self.slots, *self.retired]:
            member.kill()


def schedule(plan: ChurnPlan, rng: random.Random) -> list[str]:
    """The events in a seeded order: the churn's, each pair in its order, with the faults among them."""
    churn = ["join", "remove", "readd", "leave", "return", "tighten", "rollout", "depart"]
    rng.shuffle(churn)
    for before, after in (("leave", "return"), ("join", "depart")):
        i, j = churn.index(before), churn.index(after)
        if i > j:
            churn[i], churn[j] = churn[j], churn[i]
    # The removed topic comes back last of the churn: its drain has the time it needs to dead-letter
    # something whatever the seed (a return a few seconds after the removal, across a rebalance and a
    # kill, had left nothing dead-lettered, and the suite's check that the fate was counted failed).
    churn.remove("readd")
    churn.append("readd")
    events = list(churn)
    extra = ["kill"] * plan.kills
    extra += ["state"] if plan.state_loss else []
    extra += ["broker"] if plan.broker_restart else []
    extra += ["zombie"] if plan.zombie else []
    for kind in extra:
        events.insert(rng.randrange(len(events) + 1), kind)
    return events


class Run:
    """One churn run: the broker, the members, the policy file and the events between them."""

    def __init__(self, plan: ChurnPlan, workdir: Path, log: Any, command: str) -> None:
        self.plan, self.workdir, self.log = plan, workdir, log
        self.rng = random.Random(plan.seed + 3)
        self.outcome = Outcome(plan)
        self.broker = bench_broker(workdir / "broker")
        self.bootstrap = self.broker.start()
        self.outcome.dated = dated_lines(self.broker, command)
        self.policies = workdir / "policies.yaml"
        self.removable, self.late, self.capped_max = True, False, LOOSE_MAX
        self._write_policies()
        for topic, subs in TOPICS.items():
            for name in (topic, f"{topic}.dlt", *(f"{topic}.{s}" for s in subs)):
                create_topic(self.bootstrap, name, PARTITIONS)
        self.members = Members(workdir, self.bootstrap, self.policies, plan, self.outcome)

    def _drain_begun(self) -> float:
        """Wait, up to DRAIN_WAIT_S, until the removed topic's drain has dead-lettered a record (read
        as the count reads): a return before then leaves the TOPIC_REMOVED fate unchecked. In CI a
        removal of 14 s, amid a rollout, a join and a lost state dir, had dead-lettered nothing."""
        began = time.monotonic()
        while time.monotonic() - began < DRAIN_WAIT_S and not self._dead_letters():
            time.sleep(0.5)
        return time.monotonic() - began

    def _pending_committed(self) -> float:
        """Wait, up to PENDING_WAIT_S, until a commit of the group holds pending records of the
        topic about to be removed: only those are the drain's to dead-letter (contract section 2;
        records no member had committed are read as the topic's own). In CI, exactly once, the
        members killed and started again four times in the run's first 15 s had committed nothing
        of it when it was removed, and the run found no TOPIC_REMOVED fate to check."""
        began = time.monotonic()
        while time.monotonic() - began < PENDING_WAIT_S:
            try:
                commits = group_commits(self.bootstrap, GROUP, "removable", PARTITIONS)
            except KafkaException:
                commits = []  # a node just started again: not yet
            if any(holds_pending(offset, metadata) for offset, metadata in commits):
                break
            time.sleep(0.5)
        return time.monotonic() - began

    def _dead_letters(self) -> bool:
        """Whether removable.dlt holds a record (read_committed, as the count reads; at least once
        nothing is transactional). A node that has just started again may answer NOT_LEADER for a
        moment (CI): that is "not yet"."""
        try:
            return bool(read_all(self.bootstrap, "removable.dlt"))
        except KafkaException:
            return False

    def _write_policies(self) -> None:
        self.policies.write_text(policy_text(self.removable, self.late, self.capped_max))

    def apply(self, kind: str) -> str:
        """Carry out one event; what it did, in words."""
        members, running = self.members, sorted(self.members.running)
        if kind in ("kill", "state", "zombie"):
            if not running:
                return "skipped: no member running"
            slot = self.rng.choice(running)
            if kind == "zombie":
                self.outcome.zombie = members.replace(slot)
                return f"churn-{slot} replaced; the woken one: {self.outcome.zombie}"
            members.kill(slot)
            if kind == "state":
                shutil.rmtree(members.slots[slot].state, ignore_errors=True)
            members.start(slot)
            return f"churn-{slot}"
        if kind == "broker":
            self.broker.stop()
            time.sleep(2)
            self.broker.start()
            return "stopped 2 s"
        if kind in ("remove", "readd", "tighten"):
            waited = self._drain_begun() if kind == "readd" else None
            pending_waited = self._pending_committed() if kind == "remove" else None
            if kind == "tighten":
                self.capped_max = f"{self.plan.tight_s:g}s"
            else:
                self.removable = kind == "readd"
            self._write_policies()
            time.sleep(SETTLE_S)
            after = f" (after {waited:.0f} s for the drain's first dead letter)" if waited is not None else ""
            if pending_waited is not None:
                after = f" (after {pending_waited:.0f} s for a commit holding pending records of it)"
            return f"policy: removable {'in' if self.removable else 'out'}, capped max {self.capped_max}{after}"
        if kind == "rollout":
            how = self.rng.choice(["SIGTERM", "kill -9"])
            if how == "SIGTERM":
                members.stop(running)
            else:
                for slot in running:
                    members.kill(slot)
            self.late = True
            self._write_policies()
            for slot in running:
                members.start(slot)
            return f"{how} of {['churn-' + str(s) for s in running]}, `late` added, started again"
        slot = {"join": 2, "leave": 1, "return": 1, "depart": 0}[kind]
        if kind in ("join", "return"):
            members.start(slot)
        else:
            members.stop([slot])
        return f"churn-{slot}"

    def go(self, spark: SparkSession | None) -> Outcome:
        plan, outcome, started = self.plan, self.outcome, time.monotonic()
        # Cancels are sent within a delay span of their records, not within the whole window.
        cancel_plan = dataclasses.replace(plan, window_s=plan.delay_s)
        production = Production(self.bootstrap, plan)
        cancels = Cancels(self.bootstrap, cancel_plan, production.produced["steady"], production.positions["steady"],
                          topic="steady")  # fmt: skip
        try:
            for slot in (0, 1):
                self.members.start(slot)
            production.start()
            cancels.start()
            events = schedule(plan, random.Random(plan.seed))
            instants = sorted(self.rng.uniform(0.05, 0.95) * plan.window_s for _ in events)
            for kind, at in zip(events, instants, strict=True):
                time.sleep(max(started + at - time.monotonic(), 0))
                start_ms = int(time.time() * 1000)
                self.log(f"[churn] {kind} at {time.monotonic() - started:.1f}s")
                detail = self.apply(kind)
                outcome.events.append(Event(kind, start_ms, int(time.time() * 1000), detail))
            faults_over = time.monotonic()
            production.events_done.set()
            production.join(plan.window_s + plan.delay_s + 120)
            if production.error is not None:
                raise RuntimeError(f"production failed: {production.error!r}")
            cancels.finish()
            while production.held and time.monotonic() < max(production.held) + 2:
                time.sleep(0.5)
            outcome.held_due = sum(faults_over < at < time.monotonic() for at in production.held)
            self._settle(production, cancels)
            cancels.stop()
            if cancels.error is not None:
                outcome.notes.append(f"canceller failed: {cancels.error!r}")
            outcome.unclean_exits += [f"churn-{s} had exited by itself" for s in self.members.running
                                      if not self.members.alive(s)]  # fmt: skip
            self.members.stop(sorted(self.members.running))
            outcome.fates = count(self.bootstrap, production.asked, cancels.sent, outcome.events, plan)
            if plan.spark_audit:
                outcome.spark = spark_audit(self.bootstrap, self.policies, self.workdir, spark)
                outcome.spark.disagreements = disagreements(outcome.fates, outcome.spark)
        finally:
            cancels.stop()
            self.members.close()
            self.broker.stop()
        outcome.wall_s = time.monotonic() - started
        return outcome

    def _settle(self, production: Production, cancels: Cancels) -> None:
        """Until every record has a fate (or a deadline passes), then a few commit intervals more:
        copies that should not exist would come now."""
        deadline = time.monotonic() + 300 + self.plan.records / 500
        while True:
            fates = count(self.bootstrap, production.asked, cancels.sent, self.outcome.events, self.plan)
            if not sum(fates.lost.values()):
                break
            if time.monotonic() > deadline:
                self.outcome.notes.append(f"records without a fate at the deadline: {fates.lost}")
                break
            time.sleep(5)
        time.sleep(self.plan.commit_interval_ms / 1000 * 4 + 2)


def table(outcome: Outcome, command: str) -> str:
    f, plan = outcome.fates, outcome.plan
    kinds = Counter(e.kind for e in outcome.events)
    rows = [
        ("command", f"`{command}`"),
        ("guarantee, seed", f"{plan.guarantee}, {plan.seed}"),
        (
            f"records (deliver-after 0 to {plan.delay_s:.0f} s) per topic",
            ", ".join(f"{t} {n:,}" for t, n in f.produced.items()),
        ),
        ("member starts / SIGKILLs / lost state dirs", f"{outcome.member_starts} / {kinds['kill']} / {kinds['state']}"),
        (
            "joins, leaves, returns on an old state dir, departures",
            f"{kinds['join']}, {kinds['leave']}, {kinds['return']}, {kinds['depart']}",
        ),
        (
            "topic removed and added back / added across a restart / max delay tightened",
            f"{kinds['remove']} / {kinds['rollout']} / {kinds['tighten']}",
        ),
        ("broker restarts", str(kinds["broker"])),
        ("woken zombie", outcome.zombie or "no zombie"),
        (
            "cancels sent / answered cancelled / held records due after the faults",
            f"{f.cancels_sent:,} / {f.cancelled:,} / {outcome.held_due}",
        ),
        ("delivered (per subscription)", ", ".join(f"{k} {v:,}" for k, v in sorted(f.delivered.items()))),
        (
            "dead-lettered (per topic and code)",
            ", ".join(f"{k} {v:,}" for k, v in sorted(f.dead_lettered.items())) or "none",
        ),
        (
            "records that could have had either fate",
            ", ".join(f"{k} {v:,}" for k, v in sorted(f.either.items()) if v) or "none",
        ),
        (
            "replaced by a newer record of their key, or tombstones (keyed) / of them delivered",
            f"{sum(f.replaced.values()):,} / {f.replaced_delivered}",
        ),
        ("lost", str(sum(f.lost.values()))),
        (
            "copies past the first / allowed (at least once, near a fault)",
            f"{sum(f.duplicated.values())} / {f.repeats_allowed}",
        ),
        ("early", str(sum(f.early.values()))),
        (
            "two fates (of them allowed at least once) / wrong code / wrong fate for the policy in force",
            f"{f.two_fates} ({f.two_fates_allowed}) / {f.wrong_code} / {f.wrong_fate}",
        ),
        (
            "cancels not answered exactly once / answered again after a fault (at least once)",
            f"{f.cancels_not_answered_once} / {f.answers_repeated_allowed}",
        ),
        ("members not ended by the bench, or not exiting 0 on SIGTERM", str(len(outcome.unclean_exits))),
        ("anomalies in all", str(f.anomalies)),
    ]
    spark = outcome.spark
    rows += spark_rows(spark) if spark is not None else []
    rows.append(("wall time", f"{outcome.wall_s:.0f} s"))
    lines = ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]
    lines += [f"\nnote: {n}" for n in outcome.notes + outcome.unclean_exits]
    lines += [f"\nrecord: {e}" for e in f.examples]
    if spark is not None:
        lines += [f"\nSPARK AUDIT DISAGREES: {d}" for d in spark.disagreements]
        if spark.exit_code != 0 or spark.disagreements:
            lines += ["\nSpark audit's output (last lines):\n```", spark.output, "```"]
    lines.append("\nevents: " + "; ".join(f"{e.kind} ({e.detail})" for e in outcome.events))
    return "\n".join(lines)


def run(plan: ChurnPlan, workdir: Path, log: Any = print, spark: SparkSession | None = None,
        command: str = "bench.churn") -> Outcome:  # fmt: skip
    return Run(plan, workdir, log, command).go(spark)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--guarantee",
        choices=("exactly-once", "at-least-once"),
        default="exactly-once",
        metavar="GUARANTEE",
        help="exactly-once (the default) or at-least-once",
    )
    parser.add_argument("--records", type=int, default=20_000, metavar="N")
    parser.add_argument("--window-s", type=float, default=90.0, metavar="S", help="production and events span")
    parser.add_argument("--delay-s", type=float, default=20.0, metavar="S", help="deliver-after 0 to S")
    parser.add_argument("--tight-s", type=float, default=10.0, metavar="S", help="capped's max delay once tightened")
    parser.add_argument(
        "--hold-s", type=float, default=40.0, metavar="S", help="held records fall due S after the window"
    )
    parser.add_argument("--kills", type=int, default=8, metavar="N")
    parser.add_argument("--cancel-fraction", type=float, default=0.03, metavar="F")
    parser.add_argument("--seed", type=int, default=48, metavar="N")
    parser.add_argument("--spark-audit", action="store_true", help="also run delay-sidecar audit over the run")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the outcome as JSON")
    args = parser.parse_args(argv)
    plan = ChurnPlan(records=args.records, kills=args.kills, window_s=args.window_s, seed=args.seed,
                     nack_fraction=0.0, cancel_fraction=args.cancel_fraction, spark_audit=args.spark_audit,
                     hold_s=args.hold_s, guarantee=args.guarantee, delay_s=args.delay_s,
                     tight_s=args.tight_s)  # fmt: skip
    command = command_line("bench.churn", argv)
    outcome = in_workdir("bench-churn-", lambda workdir: run(plan, workdir, log=to_stderr, command=command))
    print(outcome.dated + "\n")
    print(table(outcome, command))
    if args.json:
        args.json.write_text(json.dumps(_str_keys(dataclasses.asdict(outcome)), indent=2, default=str))
    return 0 if outcome.passed else 1


def _str_keys(value: Any) -> Any:
    """JSON takes only text keys: a dict keyed by (partition, offset) is written with "(0, 12)"."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _str_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_str_keys(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
