"""Partition handoff from 1 to 3 instances with N records pending (issue 15, docs/scaling.md).

Usage: .venv/bin/python -m bench.handoff [--pending N] [--partitions P] [--quick] [--variants none,default]

Each variant runs on fresh topics and a fresh consumer group on one broker of its own (Apache Kafka;
DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback's figures):

1. Instance A starts alone and owns every partition (12 inbound and the control topic's).
2. N records are produced with deliver-at spread uniformly over a window that starts at a planned
   handoff instant H, far enough out that nothing falls due while A indexes them. The bench waits
   until A has indexed all N and committed every inbound partition up to its end.
3. At H - lead (6 s), instances B and C start together (fresh state dirs, so no local state of
   their own). A is idle then (nothing due, nothing to commit): on noida-db a member that joins
   while another one commits cost a lost assignment (ILLEGAL_GENERATION, an engine restart and
   duplicates; seen with a 3 s lead, when the join took 4 s and A was already delivering), so the
   join is placed where A has nothing to do, on either broker. The group rebalances (roundrobin): B and C get 2/3
   of the partitions, which they must rebuild. The window starts a few seconds after their
   assignment, which the report prints; first deliveries are counted from the later of the two.
4. Everything is delivered; the bench reads the outbound topic back and stops the instances.

Measured per new owner (B, C), for the partitions that moved to it:
- its assignment: the start of its last assignment callback, from its log (restores from the state
  topic run inside the callback, before its "partitions assigned" line);
- time from the assignment to its first delivery from each moved partition (counted from the
  partition's first deliver-at instead when that is later), target <= 2 s;
- records read from the inbound log (`messages_replayed_total`) against the records pending in the
  moved partitions (all of them: nothing was delivered before the handoff);
- when its index was complete: its last "index rebuild done" line (the unsealed tail, with the
  state topic);
- the delay the handoff added to records of moved partitions: delivery minus max(deliver-at,
  assignment), p50 / p99 / max; the same for the partitions A kept, as the baseline;
- payloads it read back from the log, records it delivered, its CPU time.
Also: the state topic's size after intake (read back), A's intake rate and RSS, and whether
anything was lost, duplicated or early.

Variants: `--state-topic none` (rebuild by replaying the log from the earliest pending offset) and the
default state topic (`<group>.state`: sealed bucket snapshots and a manifest per partition, then only
the unsealed tail from the log). A build without `--state-topic` runs the replay path only.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import psutil  # type: ignore[import-untyped,unused-ignore]

from bench.probe import (
    Watermarks,
    create_topic,
    group_commits,
    metric_sum,
    now_ms,
    read_records,
    scrape,
    settle,
    wait_for_outbound,
)
from bench.procs import Child, bench_broker, load_argv, py_spy, run_load, start_sidecar
from bench.report import command_line, environment, header
from sidecar.broker.ports import free_ports
from sidecar.outbound.records import read_delivery

CONTROL_TOPIC = "delay-sidecar.control"
SUBSCRIPTION = "a"
NAMES = ("A", "B", "C")
_ASSIGNED = re.compile(r'^ts=(\S+) .*event="partitions assigned" partitions=(\S+)')
_REBUILT = re.compile(r'^ts=(\S+) .*event="index rebuild done" partition=(\S+)')
# Lines written inside the assignment callback, before "partitions assigned": where it started.
_RESTORED = re.compile(r'^ts=(\S+) .*event="index restored from the state topic" partition=(\S+) .* ms=(\d+)')
_IN_ASSIGN = re.compile(r'^ts=(\S+) .*event="(index rebuild started|state topic not usable|local index is stale)')
PAYLOAD_READS = "delay_sidecar_payload_reads_total{"
_RESTART = re.compile(r'event="engine failed')


def supports_state_topic() -> bool:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    return "--state-topic" in done.stdout


def log_ms(stamp: str) -> int:
    """A log line's ts (local time, ms) as epoch ms."""
    return int(datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f").timestamp() * 1000)


def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> list[int]:
    """The group's committed offsets."""
    return [offset for offset, _ in group_commits(bootstrap, group, topic, partitions)]


def wait_until(check: Any, timeout_s: float, what: str, alive: Any = lambda: True) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if not alive():
            raise RuntimeError(f"an instance exited while waiting for {what}")
        if check():
            return time.monotonic() - started
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@dataclass
class TopicBytes:
    records: int = 0
    keys: int = 0
    bytes_all: int = 0
    """Keys and values of every record read back."""
    bytes_latest: int = 0
    """Keys and values of the latest record per key, tombstones left out: the topic once compacted."""


def read_state_topic(bootstrap: str, topic: str, watermarks: Watermarks) -> TopicBytes | None:
    """The state topic's size, read back from the start; None when it does not exist."""
    metadata = watermarks._consumer.list_topics(topic, timeout=10).topics.get(topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        return None
    out = TopicBytes()
    latest: dict[tuple[int, bytes], int] = {}
    for m in read_records(bootstrap, topic, watermarks):
        key, value = m.key() or b"", m.value()
        size = len(key) + len(value or b"")
        out.records += 1
        out.bytes_all += size
        latest[(m.partition(), key)] = size if value is not None else -1
    out.keys = sum(1 for size in latest.values() if size >= 0)
    out.bytes_latest = sum(size for size in latest.values() if size >= 0)
    return out


@dataclass
class Outbound:
    partition: np.ndarray[Any, np.dtype[np.int64]]
    offset: np.ndarray[Any, np.dtype[np.int64]]
    deliver_at: np.ndarray[Any, np.dtype[np.int64]]
    delivered: np.ndarray[Any, np.dtype[np.int64]]


def read_outbound(bootstrap: str, topic: str, watermarks: Watermarks) -> Outbound:
    """Every outbound record's origin partition and offset, deliver-at and delivery time (its timestamp)."""
    cols: list[list[int]] = [[], [], [], []]
    part, off, at, ts = cols
    for m in read_records(bootstrap, topic, watermarks, timeout_s=600.0):
        d = read_delivery(dict(m.headers() or ()))  # the last value of a name wins, as the sidecar appends
        part.append(d.partition)
        off.append(d.offset)
        at.append(d.deliver_at)
        ts.append(m.timestamp()[1])
    p, o, due, t = (np.asarray(c, dtype=np.int64) for c in cols)
    return Outbound(p, o, due, t)


@dataclass
class Member:
    name: str
    port: int
    child: Child
    assigned: list[tuple[int, int, set[int]]] = field(default_factory=list)
    """(start, end, inbound partitions) of each assignment after the handoff began: end is the
    "partitions assigned" line, start the earliest line of the same callback (a restore from the
    state topic runs inside it, before that line), epoch ms."""
    restore_ms: dict[int, int] = field(default_factory=dict)
    """Inbound partition -> how long its restore from the state topic took."""
    rebuilt: dict[int, int] = field(default_factory=dict)
    """Inbound partition -> epoch ms of its "index rebuild done" line."""
    restarts: int = 0
    cpu_s: float = 0.0
    """CPU time of the process, user and system, from its start to the end of the deliveries."""


def parse_log(member: Member, topic: str, since_ms: int) -> None:
    began: int | None = None
    for line in member.child.log.read_text(errors="replace").splitlines():
        if _RESTART.search(line):
            member.restarts += 1
        if m := _RESTORED.match(line):
            stamp = log_ms(m.group(1)) - int(m.group(3))
            began = stamp if began is None else min(began, stamp)
            if m.group(2).startswith(topic + "/"):
                member.restore_ms[int(m.group(2).rsplit("/", 1)[1])] = int(m.group(3))
        elif m := _IN_ASSIGN.match(line):
            stamp = log_ms(m.group(1))
            began = stamp if began is None else min(began, stamp)
        if m := _ASSIGNED.match(line):
            stamp = log_ms(m.group(1))
            if stamp >= since_ms:
                names = m.group(2).split(",")
                parts = {int(n.rsplit("/", 1)[1]) for n in names if n.startswith(topic + "/")}
                member.assigned.append((min(began or stamp, stamp), stamp, parts))
            began = None
        elif m := _REBUILT.match(line):
            name = m.group(2)
            if name.startswith(topic + "/"):
                member.rebuilt[int(name.rsplit("/", 1)[1])] = log_ms(m.group(1))


def pct(values: np.ndarray[Any, Any], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def one_run(
    bootstrap: str, workdir: Path, variant: str | None, args: argparse.Namespace, watermarks: Watermarks
) -> dict[str, Any]:
    """One handoff from A to A, B, C. `variant`: the --state-topic value, None for the default."""
    label = "default" if variant is None else variant
    if not args.state_topic_supported:
        label = "replay (no --state-topic yet)"
    run = f"{(variant or 'default').replace('.', '-')}-{uuid.uuid4().hex[:6]}"
    topic, group = f"handoff-{run}", f"bench-handoff-{run}"
    outbound = f"{topic}.{SUBSCRIPTION}"
    create_topic(bootstrap, topic, args.partitions)
    policies = workdir / f"{run}-policies.yaml"
    policies.write_text(f"topics:\n  {topic}:\n    subscriptions:\n      {SUBSCRIPTION}: {{}}\n")
    base_port = free_ports(3)
    common = ["--log-level", "INFO", "--bucket-min-index-count", str(args.bucket_min_index_count), *args.sidecar_arg]
    if variant is not None and args.state_topic_supported:
        common += ["--state-topic", variant]

    def sidecar_argv(name: str, port: int) -> list[str]:
        return [
            sys.executable, "-m", "sidecar", "run", "--bootstrap-servers", bootstrap, "--policies", str(policies),
            "--state-dir", str(workdir / f"{run}-{name}"), "--metrics-port", str(port), "--group-id", group,
            "--instance-id", f"{run}-{name}", *common,
        ]  # fmt: skip

    figures: dict[str, Any] = {"variant": label, "pending": args.pending, "partitions": args.partitions}
    members: list[Member] = []
    profilers: list[Child] = []
    try:
        # 1. A alone, owning everything.
        a_child = start_sidecar(
            bootstrap, policies, workdir / f"{run}-A", base_port, group, workdir / f"{run}-A.log",
            "--instance-id", f"{run}-A", *common,
        )  # fmt: skip
        members.append(Member("A", base_port, a_child))
        control = watermarks.partitions(CONTROL_TOPIC)
        settle([base_port], args.partitions + control)
        rss_before = psutil.Process(a_child.pid).memory_info().rss
        # 2. The pending records, due over a window from H on.
        intake_est_s = 10 + args.pending / args.assume_intake_rate
        handoff_ms = now_ms() + int(intake_est_s * 1000) + args.lead_ms
        window_ms = args.window_s * 1000
        produce = run_load(
            load_argv(bootstrap, topic, args.pending, "deliver-at", handoff_ms, window_ms), workdir / f"{run}-load.log"
        )
        figures["produce_rate"] = round(produce["rate"])
        intake_started = time.monotonic() - produce["seconds"]
        ends = watermarks.ends(topic)
        assert sum(ends) == args.pending, f"{sum(ends)} records in {topic}, expected {args.pending}"

        def indexed() -> bool:
            return bool(metric_sum(scrape(base_port), "delay_sidecar_messages_delayed_total") >= args.pending)

        wait_until(indexed, 600, "A indexing every record", a_child.alive)
        figures["intake_s"] = round(time.monotonic() - intake_started, 1)
        figures["intake_rate"] = round(args.pending / figures["intake_s"])
        wait_until(
            lambda: committed_offsets(bootstrap, group, topic, args.partitions) == ends,
            120,
            "A committing",
            a_child.alive,
        )
        figures["rss_a_mib"] = round(psutil.Process(a_child.pid).memory_info().rss / 2**20)
        figures["rss_per_pending_b"] = round(
            (psutil.Process(a_child.pid).memory_info().rss - rss_before) / args.pending
        )
        state_topic = f"{group}.state" if variant is None else variant
        figures["state_topic"] = read_state_topic(bootstrap, state_topic, watermarks) if variant != "none" else None
        left_ms = handoff_ms - args.lead_ms - now_ms()
        figures["idle_before_handoff_s"] = round(left_ms / 1000, 1)
        if left_ms < 0:
            raise RuntimeError(
                f"intake took {figures['intake_s']} s, past the planned handoff: lower --assume-intake-rate "
                f"(now {args.assume_intake_rate}/s)"
            )
        time.sleep(left_ms / 1000)
        # 3. B and C join together.
        start_ms = now_ms()
        figures["handoff_at_ms"] = start_ms
        for i, name in enumerate(NAMES[1:], 1):
            port = base_port + i
            child = Child(sidecar_argv(name, port), workdir / f"{run}-{name}.log")
            members.append(Member(name, port, child))
        for member in members[1:]:
            wait_until(lambda m=member: _answers(m.port), 60, f"{member.name}'s metrics", member.child.alive)
            if args.profile_s:  # once it answers: py-spy needs the interpreter up
                profilers.append(_profile(member.child.pid, args.profile_s, workdir / f"{run}-{member.name}.py-spy"))
        ports = [m.port for m in members]
        figures["settle_s"] = round(settle(ports, args.partitions + control), 1)
        # 4. Everything delivered.
        progress = wait_for_outbound(
            watermarks, [outbound], args.pending, timeout_s=args.window_s + 300, poll_s=0.5,
            alive=lambda: all(m.child.alive() for m in members),
        )  # fmt: skip
        figures["all_delivered"] = progress.done_s is not None
        metrics = {m.name: scrape(m.port) for m in members}
        for member in members:
            cpu = psutil.Process(member.child.pid).cpu_times()
            member.cpu_s = cpu.user + cpu.system
    finally:
        for profiler in profilers:
            profiler.stop()
        for member in members:
            member.child.stop()
    for member in members:
        parse_log(member, topic, start_ms)
    delivered = read_outbound(bootstrap, outbound, watermarks)
    figures["members"] = _summarise(members, metrics, delivered, ends, args, handoff_ms)
    return figures


def _profile(pid: int, seconds: int, out: Path) -> Child:
    """py-spy on a new owner from its first answer, idle samples included: the loop is one thread, so
    time it spends waiting on a fetch is time its first delivery waits too."""
    binary = py_spy()
    if binary is None:
        raise RuntimeError("--profile-s needs py-spy in the venv (.venv/bin/pip install py-spy)")
    argv = [binary, "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--idle", "--nonblocking"]
    return Child([*argv, "--duration", str(seconds), "-o", str(out.with_suffix(".txt"))], out.with_suffix(".log"))


def _answers(port: int) -> bool:
    try:
        scrape(port, timeout_s=0.5)
    except OSError:
        return False
    return True


def _summarise(
    members: list[Member],
    metrics: dict[str, dict[str, float]],
    out: Outbound,
    ends: list[int],
    args: argparse.Namespace,
    window_start_ms: int,
) -> dict[str, Any]:
    """Per member: what it got, what it read, how soon its moved partitions delivered."""
    keys = out.partition << 40 | out.offset
    unique = np.unique(keys)
    summary: dict[str, Any] = {
        "delivered": len(keys),
        "unique": len(unique),
        "duplicates": len(keys) - len(unique),
        "missing": args.pending - len(unique),
        "early": int(np.sum(out.delivered < out.deliver_at)),
    }
    owner: dict[int, tuple[str, int]] = {}
    for member in members:
        if member.assigned:
            stamp, _, parts = member.assigned[-1]
            for p in parts:
                owner[p] = (member.name, stamp)
    rows = []
    for member in members:
        owned = sorted(p for p, (name, _) in owner.items() if name == member.name)
        stamp, assigned_end = member.assigned[-1][:2] if member.assigned else (0, 0)
        # Its deliveries: from its partitions, at or after its assignment (before it, the old owner's).
        mine = np.isin(out.partition, owned)
        before = int(np.sum(mine & (out.delivered < stamp)))
        mask = mine & (out.delivered >= stamp)
        due_from = np.maximum(out.deliver_at[mask], stamp)
        added = (out.delivered[mask] - due_from) / 1000
        firsts = []
        for p in owned:
            sel = mask & (out.partition == p)
            if not sel.any():
                continue
            first_due = int(out.deliver_at[sel].min())
            firsts.append((int(out.delivered[sel].min()) - max(stamp, first_due)) / 1000)
        samples = metrics.get(member.name, {})
        restores = {
            k.split('result="', 1)[1].rstrip('"}'): v
            for k, v in samples.items()
            if k.startswith("delay_sidecar_state_restores_total{")
        }
        # The index is complete when its tail has been read again, or at once when there was none.
        rebuilt = [(member.rebuilt.get(p, assigned_end) - stamp) / 1000 for p in owned]
        rows.append(
            {
                "name": member.name,
                "moved": member.name != "A",
                "partitions": owned,
                "rounds": len(member.assigned),
                "pending": sum(ends[p] for p in owned),
                "read": metric_sum(samples, "delay_sidecar_messages_replayed_total"),
                "restores": restores,
                "first_min_s": min(firsts, default=float("nan")),
                "first_max_s": max(firsts, default=float("nan")),
                "rebuilt_max_s": max(rebuilt, default=float("nan")) if member.name != "A" else float("nan"),
                "in_callback_s": (assigned_end - stamp) / 1000,
                "restore_ms_max": max(member.restore_ms.values(), default=0),
                "added_p50_s": pct(added, 50),
                "added_p99_s": pct(added, 99),
                "added_max_s": float(added.max()) if len(added) else float("nan"),
                "restarts": member.restarts,
                "delivered": metric_sum(samples, "delay_sidecar_messages_delivered_total"),
                "payload_reads_log": sum(
                    v for k, v in samples.items() if k.startswith(PAYLOAD_READS) and 'source="log"' in k
                ),
                "cpu_s": round(member.cpu_s, 1),
                "assigned_at_ms": stamp,
                "delivered_before_assignment": before,
                "window_after_assignment_s": (window_start_ms - stamp) / 1000,
            }
        )
    summary["rows"] = rows
    return summary


def print_report(env: dict[str, Any], args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    print("\n".join(header(env)))
    print(
        f"- {args.pending:,} records pending in {args.partitions} partitions, 1 subscription, due uniformly over "
        f"{args.window_s} s from the handoff; --bucket-min-index-count {args.bucket_min_index_count:,}\n"
    )
    print(
        "| variant | owner | partitions (after) | pending in them | read from the log | read / pending | "
        "restores | assignment callback, s (restores run in it) | assigned -> first delivery, s (min / max over "
        "partitions) | index complete, s after assignment | delay added by the handoff, s (p50 / p99 / max) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for run in runs:
        for row in run["members"]["rows"]:
            who = row["name"] + (" (new)" if row["moved"] else " (kept)")
            restores = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["restores"].items()) if v) or "-"
            share = row["read"] / row["pending"] if row["pending"] else float("nan")
            print(
                f"| {run['variant']} | {who} | {len(row['partitions'])} | {row['pending']:,} | {row['read']:,.0f} | "
                f"{share:.2f} | {restores} | {row['in_callback_s']:.2f} | "
                f"{row['first_min_s']:.2f} / {row['first_max_s']:.2f} | "
                f"{row['rebuilt_max_s']:.1f} | {row['added_p50_s']:.2f} / {row['added_p99_s']:.2f} / "
                f"{row['added_max_s']:.2f} |"
            )
    print()
    print("| variant | owner | records it delivered | payloads it read back from the log | CPU, s (from its start) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for run in runs:
        for row in run["members"]["rows"]:
            print(
                f"| {run['variant']} | {row['name']} | {row['delivered']:,.0f} | {row['payload_reads_log']:,.0f} | "
                f"{row['cpu_s']:,.1f} |"
            )
    print()
    for run in runs:
        m = run["members"]
        st: TopicBytes | None = run.get("state_topic")
        state = (
            f"state topic {st.records:,} records, {st.bytes_all / 2**20:.1f} MiB read back "
            f"({st.keys:,} live keys, {st.bytes_latest / 2**20:.1f} MiB once compacted, "
            f"{st.bytes_latest / run['pending'] * 1e6 / 2**20:.1f} MiB per million pending)"
            if st is not None
            else "no state topic"
        )
        rounds = ", ".join(f"{r['name']} {r['rounds']}" for r in m["rows"])
        gap = max(r["window_after_assignment_s"] for r in m["rows"] if r["moved"])
        early_old = sum(r["delivered_before_assignment"] for r in m["rows"] if r["moved"])
        restarts = sum(r["restarts"] for r in m["rows"])
        print(
            f"- {run['variant']}: intake {run['intake_rate']:,}/s ({run['intake_s']} s, producer "
            f"{run['produce_rate']:,}/s), A idle {run['idle_before_handoff_s']} s before B and C started, "
            f"group settled {run['settle_s']} s after; A's RSS {run['rss_a_mib']} MiB ({run['rss_per_pending_b']} B "
            f"per pending record over its RSS before the load); {state}; assignments after the handoff: {rounds}; "
            f"window start minus the new owners' assignment {gap:+.1f} s ({early_old:,} records of moved "
            f"partitions delivered before it, by A); engine restarts {restarts}; "
            f"delivered {m['delivered']:,}, missing {m['missing']:,}, "
            f"duplicates {m['duplicates']:,}, early {m['early']:,}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pending", type=int, default=1_000_000, help="records pending at the handoff")
    parser.add_argument("--partitions", type=int, default=12, help="partitions of the inbound topic")
    parser.add_argument("--window-s", type=int, default=0, help="deliver-at spread (default: pending / 10,000/s)")
    parser.add_argument("--lead-ms", type=int, default=6_000, help="B and C start this long before the window")
    parser.add_argument(
        "--assume-intake-rate", type=float, default=15_000, help="records/s A is assumed to index at, to place H"
    )
    parser.add_argument(
        "--bucket-min-index-count", type=int, default=None, help="the sidecar's (default 50,000; 5,000 with --quick)"
    )
    parser.add_argument("--variants", default="none,default", help="--state-topic values, 'default' for none given")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the variants, alternating their order")
    parser.add_argument("--quick", action="store_true", help="100,000 pending, buckets of 5,000 (for debugging)")
    parser.add_argument("--sidecar-arg", action="append", default=[], help="an extra argument for every instance")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs) after the run")
    parser.add_argument(
        "--profile-s", type=int, default=0, help="py-spy B and C for this long from their start (implies --keep)"
    )
    args = parser.parse_args(argv)
    args.keep = args.keep or bool(args.profile_s)
    if args.quick:
        args.pending = 100_000
    if args.bucket_min_index_count is None:
        args.bucket_min_index_count = 5_000 if args.quick else 50_000
    if not args.window_s:
        args.window_s = max(20, args.pending // 10_000)
    command = command_line("bench.handoff", argv)
    variants: list[str | None] = [None if v == "default" else v for v in args.variants.split(",")]
    args.state_topic_supported = supports_state_topic()
    if not args.state_topic_supported:
        print("[handoff] this build has no --state-topic: the replay path only", file=sys.stderr, flush=True)
        variants = ["none"]
    order = [v for r in range(args.rounds) for v in (variants if r % 2 == 0 else variants[::-1])]
    workdir = Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    runs = []
    try:
        with bench_broker(workdir / "broker") as broker:
            env = environment(broker, command)
            watermarks = Watermarks(broker.bootstrap_servers)
            try:
                for variant in order:
                    print(f"[handoff] --state-topic {variant or '(default)'} ...", file=sys.stderr, flush=True)
                    runs.append(one_run(broker.bootstrap_servers, workdir, variant, args, watermarks))
                    print(f"[handoff] {runs[-1]}", file=sys.stderr, flush=True)
            finally:
                watermarks.close()
    finally:
        if args.keep:
            print(f"[handoff] logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print_report(env, args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
