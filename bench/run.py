"""End-to-end benchmark of the delay sidecar against a bare Kafka relay (the ceiling).

Usage: .venv/bin/python -m bench [--quick] [--records N] [--scenarios ceiling,relay-2,passthrough,...]
                                 [--fixed-rate R] [--plot] [--profile delayed,...] [--out bench/results/e2e.json]
                                 [--rounds N]

Runs the scenarios in order, each on a fresh broker of its own (Apache Kafka;
DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback's figures, DELAY_SIDECAR_NODES=3 for three
nodes), prints a markdown table under the run's dated header and writes it with every figure to
bench/results/e2e.json (and a lateness chart with --plot). The sidecar and the relay run as
processes of their own; see bench/scenarios.py for what is timed.

A broker of its own per scenario, because noida-db kept every record in memory and wrote all of
them to one file about once a second: after five scenarios that file held 2 GB, and writing it took
CPU from the scenario then running, while the relay it is compared with ran first, on an empty
broker. Apache Kafka keeps its log on disk, but a fresh broker per scenario still gives each the
same start (no earlier scenario's log, page cache or group state). `--one-broker` runs every
scenario on one broker, as runs before 2026-11-27 13:00 UTC did.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.context import Context, Result, Sizes
from bench.procs import bench_broker
from bench.report import command_line, environment, markdown, plot, write_json
from bench.scenarios import EXTRA_SCENARIOS, RUNNERS, SCENARIOS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "e2e.json"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test, about a minute)")
    parser.add_argument("--records", type=int, help="records of every scenario (the burst gets half)")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}, or also {','.join(EXTRA_SCENARIOS)} "
        "(the delayed scenario without the payload cache); run in the order given",
    )
    parser.add_argument("--window-s", type=float, help="delays of the delayed scenario are uniform in [0, this)")
    parser.add_argument("--fixed-delay-s", type=float, help="fixed_delivery_delay of the fixed-delay topic")
    parser.add_argument("--fixed-rate", type=float, help="produce rate of fixed-40k in records/s (default 40,000)")
    parser.add_argument("--partitions", type=int, help="partitions of each inbound topic (default 3)")
    parser.add_argument("--plot", action="store_true", help="also draw lateness over time (PNG next to the JSON)")
    parser.add_argument("--profile", default="", help="scenarios whose sidecar py-spy samples (py-spy installed)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (broker data, logs, profiles)")
    parser.add_argument(
        "--one-broker", action="store_true", help="run every scenario on one broker (each gets its own by default)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="run the scenarios N times, in the order given and then reversed, by turns; a ratio between "
        "two scenarios (keyed against without keys) is then judged by its median over the rounds",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    unknown = {s for s in args.scenarios.split(",") if s} - set(SCENARIOS) - set(EXTRA_SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {','.join(SCENARIOS)}")
    return args


def sizes_for(args: argparse.Namespace) -> Sizes:
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.records:
        sizes.scaled(args.records)
    if args.window_s is not None:
        sizes.window_ms = int(args.window_s * 1000)
    if args.fixed_delay_s is not None:
        sizes.fixed_delay_ms = int(args.fixed_delay_s * 1000)
    if args.fixed_rate is not None:
        sizes.fixed_rate = args.fixed_rate
    if args.partitions:
        sizes.partitions = args.partitions
    return sizes


def schedule(wanted: list[str], rounds: int, one_broker: bool) -> list[tuple[int, list[str]]]:
    """The brokers to start, in order, each with its round and the scenarios it serves. Rounds go by
    turns, A B then B A, so a machine that slows down or speeds up over the run favours neither."""
    orders = [wanted if turn % 2 == 0 else wanted[::-1] for turn in range(rounds)]
    if one_broker:
        return list(enumerate(orders))
    return [(turn, [name]) for turn, order in enumerate(orders) for name in order]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run(name: str, ctx: Context) -> Result:
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    result = RUNNERS[name](ctx)
    print(
        f"[bench] {name} done in {time.monotonic() - t0:.1f}s completed={result.completed} {result.figures}",
        file=sys.stderr,
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # SIGTERM, and SIGINT in a background job (where the shell ignores it), must still stop the
    # sidecar, the relay and the broker this run started: unwind through the finally blocks.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    command = command_line("bench", argv)
    sizes = sizes_for(args)
    wanted = list(dict.fromkeys(s for s in args.scenarios.split(",") if s))  # in the order given
    workdir = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    results: list[Result] = []
    started = time.monotonic()
    try:
        groups = schedule(wanted, args.rounds, args.one_broker)
        ctx = Context("", workdir, sizes, profile=set(args.profile.split(",")) - {""})
        env: dict[str, Any] = {}
        for i, (turn, group) in enumerate(groups):
            data = workdir / f"broker-{i}"
            # A round's own files: a scenario's state dir belongs to the broker it first ran on.
            ctx.workdir = workdir if args.rounds == 1 else workdir / f"round-{turn + 1}"
            ctx.workdir.mkdir(exist_ok=True)
            with bench_broker(data) as broker:
                ctx.bootstrap = broker.bootstrap_servers
                env = env or environment(broker, command)
                for name in group:
                    results.append(_run(name, ctx))
                    results[-1].figures["round"] = turn + 1
                if ctx.watermarks is not None:
                    ctx.watermarks.close()
                    ctx.watermarks = None
            if not args.keep:
                shutil.rmtree(data, ignore_errors=True)  # a scenario's broker file can take gigabytes
        if not args.one_broker:
            env["broker"] = f"{env['broker']}, a fresh one for each scenario"
        env["duration_s"] = round(time.monotonic() - started, 1)
        table = markdown(env, results)
        print(table)
        write_json(args.out, env, results, table)
        print(f"\nwritten: {args.out}", file=sys.stderr)
        if args.plot and plot(args.out.with_suffix(".png"), results):
            print(f"written: {args.out.with_suffix('.png')}", file=sys.stderr)
        profiles = [r.figures["profile"] for r in results if r.figures.get("profile")]
        for profile in profiles:
            target = args.out.parent / Path(profile).name
            shutil.copy(profile, target)
            print(f"profile: {target} (summary: .venv/bin/python -m bench.profile_summary {target})", file=sys.stderr)
    finally:
        if args.keep:
            print(f"work dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if results and all(r.completed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
