"""Cancel and reschedule at scale: 90,000 cancels on 1M pending records, while other records fall due.

Usage: .venv/bin/python -m bench.cancel [--pending 1000000] [--cancels 90000] [--reschedules 10000]
       [--partitions 2] [--rate 1000] [--json FILE]

A topic with `--pending` records delayed by an hour, and a kept topic fed `--rate` records/s due one
second after they are produced, are served by one sidecar (in this process, on a broker of its own:
Apache Kafka; DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback's figures). Once the kept topic
delivers, `--cancels` cancel commands for distinct pending records are written to the control topic
as fast as a producer can, then `--reschedules` reschedules of other pending records (each reads its
message back to copy it). Measured per phase:

- commands per second: commands / (last outcome's timestamp - first command's);
- each command's answer time: its outcome's timestamp - its own timestamp (p50, p99, max);
- the kept topic's lateness (outbound timestamp - deliver-at) before and during the commands;
- the process's resident memory before and after, and that every command got one outcome.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Producer

from bench import load
from bench.drain import KeptLoad, lateness, quantile, read_all, serve, wait
from bench.probe import Watermarks, create_topic
from bench.procs import bench_broker
from bench.report import command_line, dated_lines
from sidecar.settings import RunSettings

PENDING, KEPT, CONTROL = "cancel.pending", "cancel.kept", "cancel.control"
HOUR_MS = 3_600_000


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


def send(bootstrap: str, kind: str, targets: list[tuple[int, int]], extra: dict[str, Any]) -> dict[str, int]:
    """One command per (partition, offset), as fast as the producer takes them; id -> send time (ms)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "queue.buffering.max.messages": 1_000_000})
    sent: dict[str, int] = {}
    for partition, offset in targets:
        command_id = f"{kind[0]}{partition}-{offset}"
        body = {"v": 1, "type": kind, "topic": PENDING, "partition": partition, "offset": offset, "id": command_id}
        sent[command_id] = time.time_ns() // 1_000_000
        producer.produce(
            CONTROL, json.dumps({**body, **extra}).encode(), key=f"{PENDING}/{partition}/{offset}".encode()
        )
        producer.poll(0)
    producer.flush(60)
    return sent


def phase(bootstrap: str, sent: dict[str, int], answers: dict[str, list[tuple[str, int]]]) -> dict[str, Any]:
    times = [stamp for command_id in sent for _, stamp in answers.get(command_id, [])]
    waits = [stamp - sent[command_id] for command_id in sent for _, stamp in answers.get(command_id, [])]
    span_s = (max(times) - min(sent.values())) / 1000 if times else None
    return {
        "commands": len(sent),
        "answered": sum(1 for command_id in sent if command_id in answers),
        "answered_twice": sum(1 for command_id in sent if len(answers.get(command_id, [])) > 1),
        "outcomes": dict(Counter(o for command_id in sent for o, _ in answers.get(command_id, []))),
        "commands_per_s": round(len(sent) / span_s) if span_s else None,
        "answer_ms_p50": quantile([float(w) for w in waits], 0.5),
        "answer_ms_p99": quantile([float(w) for w in waits], 0.99),
        "answer_ms_max": max(waits, default=None),
    }


def run(
    bootstrap: str, work: Path, pending: int, cancels: int, reschedules: int, partitions: int, rate: int
) -> dict[str, Any]:
    create_topic(bootstrap, PENDING, partitions)
    create_topic(bootstrap, KEPT, 1)
    base = time.time_ns() // 1_000_000 + HOUR_MS
    load.produce(bootstrap, PENDING, pending, mode="deliver-at", base_ms=base, window_ms=60_000)
    policies = work / "policies.yaml"
    policies.write_text(
        f"topics:\n  {PENDING}:\n    subscriptions: {{a: {{}}, b: {{}}}}\n  {KEPT}:\n    subscriptions: {{a: {{}}}}\n"
    )
    settings = RunSettings(bootstrap_servers=bootstrap, policies=policies, state_dir=work / "state",
                           metrics_port=0, group_id="cancel-bench", control_topic=CONTROL)  # fmt: skip
    app, thread, sample = serve(settings)

    def answered(kind: str) -> float:
        outcomes = ("cancelled", "rescheduled", "too-late", "unknown-message", "rejected")
        return sum(sample("delay_sidecar_commands_total", type=kind, outcome=o) for o in outcomes)

    intake_s = wait(lambda: sample("delay_sidecar_messages_delayed_total", topic=PENDING) >= pending,
                    900, "intake of the pending records")  # fmt: skip
    kept = KeptLoad(bootstrap, rate, KEPT)
    wait(lambda: sample("delay_sidecar_messages_delivered_total", topic=KEPT, subscription="a") > 0, 60,
         "the kept topic delivering")  # fmt: skip
    time.sleep(5)  # the baseline: the kept topic's lateness without commands
    rss_before = rss_mb()
    sizes = Watermarks(bootstrap).ends(PENDING)
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    chosen = random.Random(3).sample(range(sum(sizes)), cancels + reschedules)
    targets = [(p, i - starts[p]) for i in chosen for p in [bisect.bisect_right(starts, i) - 1]]
    started_ms = time.time_ns() // 1_000_000
    print("phase=commands", file=sys.stderr, flush=True)  # for a profiler to attach to
    cancel_sent = send(bootstrap, "cancel", targets[:cancels], {})
    wait(lambda: answered("cancel") >= len(cancel_sent), 900, "every cancel answered")
    moved_sent = send(bootstrap, "reschedule", targets[cancels:], {"deliver_at": base + 120_000})
    wait(lambda: answered("reschedule") >= len(moved_sent), 900, "every reschedule answered")
    ended_ms = time.time_ns() // 1_000_000
    rss_after = rss_mb()
    time.sleep(2)
    sent = kept.stop()
    wait(lambda: sample("delay_sidecar_messages_delivered_total", topic=KEPT, subscription="a") >= sent, 60,
         "the kept topic's last records")  # fmt: skip
    app.stop()
    thread.join(60)

    answers: dict[str, list[tuple[str, int]]] = {}

    def answer(m: Any) -> None:
        data = json.loads(m.value())
        answers.setdefault(data.get("id") or "", []).append((data["outcome"], m.timestamp()[1]))

    read_all(bootstrap, f"{CONTROL}.outcomes", answer)
    before, during = lateness(bootstrap, f"{KEPT}.a", started_ms, ended_ms)
    return {
        "pending": pending,
        "partitions": partitions,
        "kept_rate": rate,
        "intake_s": round(intake_s, 1),
        "cancel": phase(bootstrap, cancel_sent, answers),
        "reschedule": phase(bootstrap, moved_sent, answers),
        "kept_late_ms_before_p99": quantile(before, 0.99),
        "kept_late_ms_during_p99": quantile(during, 0.99),
        "kept_late_ms_during_max": max(during, default=None),
        "kept_early": sum(1 for late in before + during if late < 0),
        "rss_mb_before": round(rss_before),
        "rss_mb_after": round(rss_after),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.cancel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000, metavar="N", help="pending records")
    parser.add_argument("--cancels", type=int, default=90_000, metavar="N", help="cancel commands")
    parser.add_argument("--reschedules", type=int, default=10_000, metavar="N", help="reschedule commands")
    parser.add_argument("--partitions", type=int, default=2, metavar="N", help="partitions of the pending topic")
    parser.add_argument("--rate", type=int, default=1_000, metavar="R", help="kept topic records/s")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-cancel-") as tmp, bench_broker(Path(tmp) / "broker") as broker:
        dated = dated_lines(broker, command_line("bench.cancel", argv))
        sizes = (args.pending, args.cancels, args.reschedules, args.partitions, args.rate)
        result = run(broker.bootstrap_servers, Path(tmp), *sizes)
    print(dated + "\n")
    rows = [(k, v) for k, v in result.items() if not isinstance(v, dict)]
    for name in ("cancel", "reschedule"):
        rows += [(f"{name}.{k}", v) for k, v in result[name].items()]
    width = max(len(k) for k, _ in rows)
    print(f"| {'measure':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for key, value in rows:
        print(f"| {key:<{width}} | {value} |")
    ok = all(result[n]["answered"] == result[n]["commands"] and not result[n]["answered_twice"]
             for n in ("cancel", "reschedule")) and result["kept_early"] == 0  # fmt: skip
    print(f"every command answered once, nothing early: {'yes' if ok else 'NO'}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
