"""Exactly-once against at-least-once in one run: delivery rate and lateness as a consumer sees them.

Usage: .venv/bin/python -m bench.eos [--records 200000] [--window-s 20] [--intervals 100,250,1000]

In exactly-once mode a record becomes visible to a read_committed consumer only when its
transaction commits, so lateness is measured where it matters: a read_committed consumer tails
every outbound topic while the sidecar runs, and the lateness of a record is the time it arrived
there minus its deliver-at (not the outbound record's timestamp, which is when it was written).
The delivery rate is records per subscription from the first arrival to the last.

Runs, each on a fresh topic of the same broker of its own (Apache Kafka; DELAY_SIDECAR_BROKER_KIND=
noida-db for the fallback's figures): pass-through and delayed (deliver-at uniform over the window,
pre-produced) in both modes at the default commit interval, then the delayed scenario in
exactly-once mode at each commit interval. Prints a markdown table under the run's dated header.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.probe import DELIVER_AT, create_topic, now_ms
from bench.procs import bench_broker, load_argv, run_load, start_sidecar
from bench.report import command_line, environment, header
from sidecar.broker.ports import free_port

SUBSCRIPTIONS = ("billing", "shipping")
PARTITIONS = 3
STARTUP_S = 8.0


@dataclass
class Tail:
    """A read_committed consumer of the outbound topics, on a thread: when each record arrived."""

    bootstrap: str
    topics: list[str]
    expected: int
    lateness: bool
    arrived: dict[str, int] = field(default_factory=dict)
    first_ms: int | None = None
    last_ms: int | None = None
    late_ms: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Tail:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"bench-eos-tail-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 10,
                "topic.metadata.refresh.interval.ms": 500,
            }
        )
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in self.topics for p in range(PARTITIONS)])
        arrived = self.arrived = dict.fromkeys(self.topics, 0)
        try:
            while not self._stop.is_set() and min(arrived.values()) < self.expected:
                batch = consumer.consume(10_000, 0.05)
                if not batch:
                    continue
                stamp = now_ms()
                for m in batch:
                    if m.error() is not None:
                        continue
                    arrived[m.topic()] += 1
                    if self.lateness:
                        for name, value in reversed(m.headers() or ()):
                            if name == DELIVER_AT:
                                self.late_ms.append(stamp - int(value))
                                break
                if self.first_ms is None:
                    self.first_ms = stamp
                self.last_ms = stamp
        finally:
            consumer.close()

    def wait(self, timeout_s: float) -> bool:
        assert self._thread is not None
        self._thread.join(timeout_s)
        self._stop.set()
        self._thread.join(10)
        return min(self.arrived.values(), default=0) >= self.expected


@dataclass
class Run:
    scenario: str
    guarantee: str
    interval_ms: int
    records: int
    rate: float | None = None
    p50: float | None = None
    p99: float | None = None
    max_late: int | None = None
    early: int = 0
    completed: bool = False
    extra: int = 0


def one_run(bootstrap: str, workdir: Path, run: Run, window_ms: int) -> Run:
    name = f"{run.scenario}-{run.guarantee}-{run.interval_ms}"
    topic = f"bench.eos-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, PARTITIONS)
    delayed = run.scenario == "delayed"
    n = run.records
    base_ms = now_ms() + int(1000 * (STARTUP_S + n / 60_000 + n / 25_000)) if delayed else 0
    argv = load_argv(bootstrap, topic, n, "deliver-at" if delayed else "none", base_ms, window_ms)
    run_load(argv, workdir / f"{name}-load.log")
    policies = workdir / f"{name}-policies.yaml"
    subs = "".join(f"      {s}: {{}}\n" for s in SUBSCRIPTIONS)
    policies.write_text(f"topics:\n  {topic}:\n    subscriptions:\n{subs}")
    outbound = [f"{topic}.{s}" for s in SUBSCRIPTIONS]
    for target in [*outbound, f"{topic}.dlt"]:
        create_topic(bootstrap, target, PARTITIONS)  # so the tail can be assigned before the sidecar starts
    tail = Tail(bootstrap, outbound, n, lateness=delayed).start()
    sidecar = start_sidecar(
        bootstrap, policies, workdir / f"{name}-state", free_port(), f"bench-eos-{uuid.uuid4().hex[:6]}",
        workdir / f"{name}-sidecar.log", "--processing-guarantee", run.guarantee,
        "--commit-interval-ms", str(run.interval_ms),
    )  # fmt: skip
    try:
        due_s = max(base_ms + window_ms - now_ms(), 0) / 1000 if delayed else 0
        run.completed = tail.wait(due_s + 120 + n / 5_000)
    finally:
        sidecar.stop()
    run.extra = max(sum(tail.arrived.values()) - n * len(outbound), 0)
    if tail.first_ms is not None and tail.last_ms is not None and tail.last_ms > tail.first_ms:
        run.rate = n / ((tail.last_ms - tail.first_ms) / 1000)
    if tail.late_ms:
        late = np.array(tail.late_ms)
        run.p50, run.p99 = float(np.percentile(late, 50)), float(np.percentile(late, 99))
        run.max_late, run.early = int(late.max()), int((late < 0).sum())
    return run


def table(runs: list[Run]) -> str:
    def rate_of(scenario: str, guarantee: str, interval: int) -> float | None:
        found = [r.rate for r in runs if (r.scenario, r.guarantee, r.interval_ms) == (scenario, guarantee, interval)]
        return found[0] if found else None

    lines = [
        "| scenario | guarantee | commit interval (ms) | records | delivery rate (rec/s per sub) "
        "| x at-least-once | visible lateness p50 / p99 / max (ms) | early | all delivered, no extra |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in runs:
        base = rate_of(r.scenario, "at-least-once", r.interval_ms)
        ratio = f"{r.rate / base:.2f}" if r.rate and base else "-"
        late = f"{r.p50:,.0f} / {r.p99:,.0f} / {r.max_late:,}" if r.p50 is not None else "-"
        rate = f"{r.rate:,.0f}" if r.rate else "-"
        ok = "yes" if r.completed and not r.extra else f"no (extra {r.extra})"
        lines.append(
            f"| {r.scenario} | {r.guarantee} | {r.interval_ms} | {r.records:,} | {rate} | {ratio} | {late} "
            f"| {r.early} | {ok} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000, help="records of each run")
    parser.add_argument("--window-s", type=float, default=20.0, help="delays of the delayed runs: uniform in [0, this)")
    parser.add_argument("--intervals", default="100,250,1000", help="commit intervals (ms) of the exactly-once sweep")
    parser.add_argument("--scenarios", default="passthrough,delayed", help="which of passthrough,delayed")
    args = parser.parse_args(argv)
    command = command_line("bench.eos", argv)
    window_ms = int(args.window_s * 1000)
    plan: list[Run] = []
    for scenario in args.scenarios.split(","):
        for guarantee in ("at-least-once", "exactly-once"):  # the comparison, interleaved, at the default
            plan.append(Run(scenario, guarantee, 1000, args.records))
    if "delayed" in args.scenarios:
        for interval in (int(i) for i in args.intervals.split(",") if int(i) != 1000):
            plan += [Run("delayed", "exactly-once", interval, args.records)]
            plan += [Run("delayed", "at-least-once", interval, args.records)]
    workdir = Path(tempfile.mkdtemp(prefix="bench-eos-"))
    runs: list[Run] = []
    try:
        with bench_broker(workdir / "broker") as broker:
            env = environment(broker, command)
            for run in plan:
                print(
                    f"[bench.eos] {run.scenario} {run.guarantee} {run.interval_ms} ms ...", file=sys.stderr, flush=True
                )
                runs.append(one_run(broker.bootstrap_servers, workdir, run, window_ms))
                print(f"[bench.eos] {runs[-1]}", file=sys.stderr, flush=True)
        print("\n".join(header(env)) + "\n")
        print(table(runs))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if runs and all(r.completed and not r.extra for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
