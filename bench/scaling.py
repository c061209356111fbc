"""Throughput of `run --workers 1` against `run --workers 2` on this machine (docs/scaling.md).

Usage: .venv/bin/python -m bench.scaling [--records N] [--partitions P] [--rounds R]

Each run starts `delay-sidecar run --workers W` on fresh topics (two subscriptions each) and waits
until the group has settled (every inbound and control partition owned, each worker holding
some) before anything is produced, so the rebalance of a start is not timed. Then, in order:
- due burst: N records all due at one instant T, produced and indexed before T. Intake is the
  rate at which the workers indexed them (their metrics, summed); the drain rate is N over the
  time from T to the last delivery, with no producer running;
- fixed delay: N records without headers produced at full speed to a topic with a fixed delay of
  FIXED_DELAY_S, so they fall due at the producer's rate. The figures are the rate from the first
  delivery to the last on each subscription, and how long after the last record's deliver-at (the
  end of the load plus the delay) the last delivery came: the most a record was late;
- passthrough backlog: N records without a delay, produced to a topic the policies do not name
  yet; then the policies name it (SIGHUP: every worker reloads at once and subscribes, one rebalance) and the rate
  is N over the time from the first to the last delivery on each subscription.
Runs alternate (1, 2, 2, 1, ...) so a drift in the machine's load hits both alike. The broker,
the producer and the workers share the machine's cores: on two cores, a second worker competes
with the broker for the second core.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.context import SUBSCRIPTIONS
from bench.probe import (
    MetricsRecorder,
    RssSampler,
    Watermarks,
    create_topic,
    now_ms,
    settle,
    wait_for_outbound,
)
from bench.procs import bench_broker, load_argv, run_load, start_sidecar
from bench.report import command_line, environment, header
from sidecar.broker.ports import free_ports

CONTROL_TOPIC = "delay-sidecar.control"
FIXED_DELAY_S = 5


def per_second(records: int, span_s: float) -> float | None:
    """None when every record came within one poll of the outbound topics: no rate can be told then
    (a small run on a fast broker)."""
    return round(records / span_s) if span_s > 0 else None


def one_run(bootstrap: str, workdir: Path, workers: int, records: int, partitions: int) -> dict[str, float | None]:
    run = f"w{workers}-{uuid.uuid4().hex[:6]}"
    passthrough, burst, fixed = f"pass-{run}", f"burst-{run}", f"fixed-{run}"
    for topic in (passthrough, burst, fixed):
        create_topic(bootstrap, topic, partitions)
    subs = "".join(f"      {s}: {{}}\n" for s in SUBSCRIPTIONS)
    policies = workdir / f"{run}-policies.yaml"
    delay = f"    delayed_delivery: {{fixed_delivery_delay: {FIXED_DELAY_S}s}}\n"
    fixed_topic = f"  {fixed}:\n{delay}    subscriptions:\n{subs}"
    policies.write_text(f"topics:\n  {burst}:\n    subscriptions:\n{subs}{fixed_topic}")
    port = free_ports(1 + workers)
    worker_ports = [port] if workers == 1 else [port + 1 + i for i in range(workers)]
    sidecar = start_sidecar(
        bootstrap, policies, workdir / f"{run}-state", port, f"bench-{run}", workdir / f"{run}.log",
        "--workers", str(workers),
    )  # fmt: skip
    rss = RssSampler(sidecar.pid).start()
    metrics = MetricsRecorder(worker_ports).start()
    wm = Watermarks(bootstrap)
    figures: dict[str, float | None] = {"workers": workers}
    try:
        figures["settle_s"] = round(settle(worker_ports, 2 * partitions + wm.partitions(CONTROL_TOPIC)), 1)
        # Due burst: produced and indexed well before T, then all due at T.
        due_ms = now_ms() + 10_000 + records * 1_000 // 20_000
        run_load(load_argv(bootstrap, burst, records, "deliver-at", due_ms, 0), workdir / f"{run}-burst-load.log")
        due_mono = time.monotonic() + (due_ms - now_ms()) / 1000
        outbound = [f"{burst}.{s}" for s in SUBSCRIPTIONS]
        progress = wait_for_outbound(wm, outbound, records, timeout_s=180 + records / 2_000, alive=sidecar.alive)
        if progress.done_s is None:
            raise RuntimeError(f"burst not delivered: {progress.counts}; log {sidecar.log}")
        index_rate = metrics.rate("delay_sidecar_messages_delayed_total", records)
        figures["index_rate"] = None if index_rate is None else round(index_rate)
        figures["burst_drain_per_sub"] = round(records / (progress.done_s - due_mono))
        figures["burst_first_s_after_due"] = round((progress.first_s or due_mono) - due_mono, 2)
        # Fixed delay: due at the producer's rate, FIXED_DELAY_S after each record.
        run_load(load_argv(bootstrap, fixed, records), workdir / f"{run}-fixed-load.log")
        last_due = time.monotonic() + FIXED_DELAY_S
        outbound = [f"{fixed}.{s}" for s in SUBSCRIPTIONS]
        progress = wait_for_outbound(wm, outbound, records, timeout_s=180 + records / 2_000, alive=sidecar.alive)
        if progress.first_s is None or progress.done_s is None:
            raise RuntimeError(f"fixed not delivered: {progress.counts}; log {sidecar.log}")
        figures["fixed_per_sub"] = per_second(records, progress.done_s - progress.first_s)
        figures["fixed_last_late_s"] = round(max(progress.done_s - last_due, 0.0), 2)
        # Passthrough: a backlog the workers do not read until the policies name its topic.
        run_load(load_argv(bootstrap, passthrough, records), workdir / f"{run}-pass-load.log")
        both = "".join(f"  {t}:\n    subscriptions:\n{subs}" for t in (burst, passthrough))
        policies.write_text(f"topics:\n{both}{fixed_topic}")
        os.kill(sidecar.pid, signal.SIGHUP)  # every worker reloads now, so they rejoin in one rebalance
        outbound = [f"{passthrough}.{s}" for s in SUBSCRIPTIONS]
        progress = wait_for_outbound(wm, outbound, records, timeout_s=120 + records / 2_000, alive=sidecar.alive)
        if progress.first_s is None or progress.done_s is None:
            raise RuntimeError(f"passthrough not delivered: {progress.counts}; log {sidecar.log}")
        figures["passthrough_per_sub"] = per_second(records, progress.done_s - progress.first_s)
    finally:
        metrics.stop()
        wm.close()
        sidecar.stop()
        figures["peak_rss_mib"] = round(rss.stop(), 1)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000, help="records per phase and run")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of each inbound topic")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (1 then 2 workers, then 2 then 1)")
    args = parser.parse_args(argv)
    command = command_line("bench.scaling", argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    order = [w for r in range(args.rounds) for w in ((1, 2) if r % 2 == 0 else (2, 1))]
    rows = []
    try:
        with bench_broker(workdir / "broker") as broker:
            env = environment(broker, command)
            for workers in order:
                print(f"[scaling] --workers {workers} ...", file=sys.stderr, flush=True)
                rows.append(one_run(broker.bootstrap_servers, workdir, workers, args.records, args.partitions))
                print(f"[scaling] {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(header(env)))
    print(f"- {args.records:,} records per phase, {args.partitions} partitions per topic, 2 subscriptions\n")
    print("| run | workers | intake, delayed (rec/s) | due burst drain (rec/s per sub) | fixed delay: rate "
          "(rec/s per sub) | fixed delay: last delivery after the last deliver-at (s) | passthrough backlog "
          "(rec/s per sub) | peak RSS, all processes (MiB) |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, row in enumerate(rows, 1):
        cells = [str(i), f"{row['workers']:.0f}"]
        cells += [_cell(row[k]) for k in ("index_rate", "burst_drain_per_sub", "fixed_per_sub")]
        cells += [_cell(row["fixed_last_late_s"], ".2f"), _cell(row["passthrough_per_sub"]), _cell(row["peak_rss_mib"])]
        print("| " + " | ".join(cells) + " |")
    return 0


def _cell(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
