"""A backlog of nacks: how fast the sidecar redelivers 90,000 nacks written at once.

Usage: .venv/bin/python -m bench.nack_backlog [--messages 90000] [--rounds 2] [--due past|later|live] [--spread-s S]

Each round, on one broker of its own (Apache Kafka; DELAY_SIDECAR_BROKER_KIND=noida-db for the
fallback's figures), the same for every round: N records of 100 bytes are produced and delivered to
the subscription's outbound topic by a sidecar, which then stops cleanly. While it is down, a nack
of every record is written to the control topic, due one second before it was written (`--due past`)
or all at one instant 15 s later (`--due later`). The sidecar starts again: it no longer holds the
payloads it kept since intake (dispatch/recent.py), so every redelivery reads its payload back
from the inbound log. The round ends when every record came back.

With `--due live` the sidecar is not stopped: the nacks, each for 1 s (`delay_ms`), are written as
fast as one producer writes them, while the sidecar still holds the payloads it delivered, so
nothing is read back from the log. `--spread-s 1` writes them evenly over one second instead, issue
24's "90,000 nacks within about a second" to the letter; one producer writes them in 0.3 to 0.6 s
here, so the default is the harder of the two.

Figures per round, from the redelivered records themselves (their timestamps are the sidecar's
produce time): the drain (first to last redelivery), nacks redelivered per second over it, how late
the redeliveries were after their deliver-at (min / p50 / p99 / max, which with `past` includes the
sidecar's own start), and the sidecar's CPU from its start to the last redelivery.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Producer

from bench.bench_nack import (
    Watermarks,
    create_topics,
    make_records,
    percentiles,
    process_usage,
    produce_all,
    read_back,
)
from bench.procs import Child, bench_broker, start_sidecar
from bench.report import command_line, dated_lines
from sidecar.broker.ports import free_port
from sidecar.client import deliver_at as deliver_at_of
from sidecar.client import redelivery_count

PARTITIONS = 3
SUBSCRIPTION = "billing"
LATER_MS = 15_000
LIVE_DELAY_MS = 1_000


def nack_everything(
    bootstrap: str, control: str, inbound: str, ends: list[int], when: dict[str, int], spread_s: float = 0.0
) -> None:
    """A nack of every record, keyed by its message id as `sidecar.client.Nacker` keys it; `when`
    is its deliver_at or delay_ms. `spread_s`: written evenly over this long (0: as fast as it goes)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    total, written, started = sum(ends), 0, time.monotonic()
    for partition, end in enumerate(ends):
        for offset in range(end):
            written += 1
            if spread_s > 0 and written % 500 == 0:  # paced in steps of 500: a sleep per command is too coarse
                time.sleep(max(started + spread_s * written / total - time.monotonic(), 0.0))
            command = {"v": 1, "type": "nack", "subscription": SUBSCRIPTION, "topic": inbound,
                       "partition": partition, "offset": offset, **when}  # fmt: skip
            while True:
                try:
                    producer.produce(control, json.dumps(command).encode(), f"{inbound}/{partition}/{offset}".encode())
                    break
                except BufferError:
                    producer.poll(0.1)
    producer.flush()


def one_round(bootstrap: str, work: Path, n: int, due: str, timeout_s: float, spread_s: float) -> dict[str, object]:
    tag = uuid.uuid4().hex[:6]
    inbound, control = f"backlog.in-{tag}", f"backlog.ctl-{tag}"
    outbound = f"{inbound}.{SUBSCRIPTION}"
    create_topics(bootstrap, [inbound, control], PARTITIONS)
    policies = work / f"policies-{tag}.yaml"
    policies.write_text(f"topics:\n  {inbound}:\n    subscriptions:\n      {SUBSCRIPTION}: {{}}\n")
    produce_all(bootstrap, inbound, make_records(n, 100, seed=7))
    args = (bootstrap, policies, work / f"state-{tag}", free_port(), f"sidecar-{tag}", work / f"sidecar-{tag}.log")
    extra = ("--control-topic", control)
    watermarks = Watermarks(bootstrap)
    try:
        first = start_sidecar(*args, *extra)
        try:
            watermarks.wait_total(outbound, PARTITIONS, n, timeout_s, first.alive)
        finally:
            if due != "live":
                first.stop()
        sent_ms = int(time.time() * 1000)
        deliver_at = sent_ms + (-1000 if due == "past" else LATER_MS)
        when = {"delay_ms": LIVE_DELAY_MS} if due == "live" else {"deliver_at": deliver_at}
        nack_everything(bootstrap, control, inbound, watermarks.ends(inbound, PARTITIONS), when, spread_s)
        written_s = (int(time.time() * 1000) - sent_ms) / 1000
        again: Child = first if due == "live" else start_sidecar(*args, *extra)
        try:
            watermarks.wait_total(outbound, PARTITIONS, 2 * n, timeout_s, again.alive)
            usage = process_usage(again.pid)
        finally:
            again.stop()
    finally:
        watermarks.close()
    _, redelivered = read_back(bootstrap, outbound, PARTITIONS, select=lambda m: redelivery_count(m) == 1)
    stamps = [m.timestamp()[1] for m in redelivered]
    drain_s = (max(stamps) - min(stamps)) / 1000
    late = [m.timestamp()[1] - deliver_at_of(m) for m in redelivered]
    return {
        "due": due,
        "nacks_written_s": round(written_s, 2),
        "redelivered": len(stamps),
        "drain_s": round(drain_s, 2),
        "per_second": round(len(stamps) / drain_s) if drain_s > 0 else None,
        "late_ms": percentiles(late),
        "sidecar_cpu_s": round(usage.get("cpu_user_s", 0) + usage.get("cpu_system_s", 0), 1) if usage else None,
    }


def table(rows: list[dict[str, object]]) -> str:
    """The rounds as a markdown table."""
    columns = ["round", "due", "nacks written in (s)", "redelivered", "drain (s)", "per second",
               "late min / p50 / p99 / max (ms)", "sidecar CPU (s)"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for i, row in enumerate(rows, 1):
        late = row["late_ms"]
        assert isinstance(late, dict)
        spread = " / ".join(f"{late[k]:,.0f}" for k in ("min", "p50", "p99", "max"))
        # A tiny round can redeliver everything within one millisecond: no rate then.
        rate = "-" if row["per_second"] is None else f"{row['per_second']:,}"
        cells = [i, row["due"], row["nacks_written_s"], f"{row['redelivered']:,}", row["drain_s"],
                 rate, spread, row["sidecar_cpu_s"]]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=90_000, metavar="N", help="records, each nacked once")
    parser.add_argument("--rounds", type=int, default=2, metavar="N", help="rounds on the same broker")
    parser.add_argument("--due", choices=("past", "later", "live"), default="past", help="when the nacks fall due")
    parser.add_argument("--timeout-s", type=float, default=600.0, metavar="SECONDS", help="per phase")
    parser.add_argument(
        "--spread-s", type=float, default=0.0, metavar="SECONDS", help="write the nacks evenly over this long"
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="nack-backlog-"))
    rows = []
    try:
        with bench_broker(work / "broker") as broker:
            dated = dated_lines(broker, command_line("bench.nack_backlog", argv))
            for _ in range(args.rounds):
                rows.append(
                    one_round(broker.bootstrap_servers, work, args.messages, args.due, args.timeout_s, args.spread_s)
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(dated + "\n")
    print(table(rows))
    print(f"\n- load average at the end: {Path('/proc/loadavg').read_text().split()[0]}")
    return 0 if all(row["redelivered"] == args.messages for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
