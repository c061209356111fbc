"""The end-to-end scenarios. Each one uses fresh topics and a fresh consumer group on the shared broker.

Throughput is timed from the first record on the outbound topics to the last (high watermarks polled
every 50 ms), so process start-up and the group join are left out; they are reported separately.
Lateness is read from the outbound topics after the run: record timestamp (set by the sidecar's
producer when it delivers) minus the `delay-deliver-at` header.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.probe import (
    Deliveries,
    MetricsRecorder,
    RssSampler,
    Watermarks,
    create_topic,
    now_ms,
    read_deliveries,
    wait_for_outbound,
)
from bench.procs import (
    Child,
    finish_load,
    load_argv,
    run_load,
    start_load,
    start_profiler,
    start_relay,
    start_sidecar,
)
from sidecar.broker.embedded import free_port

SUBSCRIPTIONS = ("billing", "shipping")
SCENARIOS = ("ceiling", "passthrough", "delayed", "burst", "fixed")
# Run only when named: the delayed scenario again without the payload cache, for a comparison in one run.
EXTRA_SCENARIOS = ("delayed-nocache",)
NO_CACHE = ("--payload-cache-bytes", "0")


@dataclass
class Sizes:
    ceiling: int = 1_000_000
    passthrough: int = 1_000_000
    delayed: int = 1_000_000
    burst: int = 500_000
    fixed: int = 1_000_000
    window_ms: int = 60_000
    """Delays of the delayed scenario are uniform in [0, window)."""
    fixed_delay_ms: int = 20_000
    partitions: int = 3
    startup_s: float = 8.0
    """Allowance for the sidecar's start and group join, in the lead time of pre-produced delayed records."""
    produce_rate: float = 60_000.0
    index_rate: float = 25_000.0
    """Conservative rates used only to choose when pre-produced delayed records start to fall due."""

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            ceiling=30_000,
            passthrough=30_000,
            delayed=30_000,
            burst=20_000,
            fixed=30_000,
            window_ms=5_000,
            fixed_delay_ms=3_000,
            startup_s=6.0,
        )

    def scaled(self, records: int) -> Sizes:
        """Every scenario at `records`, the burst at half (the full run's proportions)."""
        self.ceiling = self.passthrough = self.delayed = self.fixed = records
        self.burst = max(records // 2, 1)
        return self

    def lead_ms(self, records: int) -> int:
        return int(1000 * (self.startup_s + records / self.produce_rate + records / self.index_rate))


@dataclass
class Result:
    name: str
    records: int
    subscriptions: int
    completed: bool = False
    delivered: dict[str, int] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=dict)
    """Lateness over time: per second of deliver-at since the first one, p50/p99/max in ms."""

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "records": self.records,
            "subscriptions": self.subscriptions,
            "completed": self.completed,
            "delivered": self.delivered,
            "figures": self.figures,
            "notes": self.notes,
            "lateness_series": self.series,
        }


@dataclass
class Context:
    bootstrap: str
    workdir: Path
    sizes: Sizes
    profile: set[str] = field(default_factory=set)
    ceiling_rate: float | None = None
    watermarks: Watermarks | None = None

    def wm(self) -> Watermarks:
        if self.watermarks is None:
            self.watermarks = Watermarks(self.bootstrap)
        return self.watermarks

    def topic(self, name: str, partitions: int | None = None) -> str:
        topic = f"bench.{name}-{uuid.uuid4().hex[:6]}"
        create_topic(self.bootstrap, topic, partitions or self.sizes.partitions)
        return topic

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def ratio(self, rate: float | None) -> float | None:
        return rate / self.ceiling_rate if rate and self.ceiling_rate else None


def _policies(ctx: Context, name: str, topic: str, fixed_delay_ms: int = 0) -> Path:
    delayed = f"    delayed_delivery:\n      fixed_delivery_delay: {fixed_delay_ms}ms\n" if fixed_delay_ms else ""
    subs = "".join(f"      {s}: {{}}\n" for s in SUBSCRIPTIONS)
    path = ctx.workdir / f"{name}-policies.yaml"
    path.write_text(f"topics:\n  {topic}:\n{delayed}    subscriptions:\n{subs}")
    return path


class _Sidecar:
    """The sidecar process with its memory sampler, metrics recorder and optional profiler."""

    def __init__(
        self, ctx: Context, name: str, topic: str, fixed_delay_ms: int = 0, extra: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        self.started = time.monotonic()
        self.state_dir = ctx.workdir / f"{name}-state"
        self.cache_disk_peak = 0
        self.child = start_sidecar(
            ctx.bootstrap,
            _policies(ctx, name, topic, fixed_delay_ms),
            self.state_dir,
            self.port,
            f"bench-{name}-{uuid.uuid4().hex[:6]}",
            ctx.log(f"{name}-sidecar"),
            *extra,
        )
        self.rss = RssSampler(self.child.pid).start()
        self.metrics = MetricsRecorder(self.port).start()
        self.profiler: Child | None = None
        self.profile_path: Path | None = None
        if name in ctx.profile:
            self.profile_path = ctx.workdir / f"profile-{name}.txt"
            self.profiler = start_profiler(self.child.pid, self.profile_path, ctx.log(f"{name}-py-spy"))

    def sample_cache_disk(self) -> None:
        """The payload cache's files on disk (what its budget bounds), at its largest so far."""
        cache = self.state_dir / "cache"
        try:
            size = sum(f.stat().st_size for f in cache.iterdir() if f.is_file())
        except OSError:
            return
        self.cache_disk_peak = max(self.cache_disk_peak, size)

    def stop(self, result: Result) -> None:
        self.metrics.stop()
        code = self.child.stop()
        result.figures["peak_rss_mib"] = round(self.rss.stop(), 1)
        result.figures["payload_reads_cache"] = int(self.metrics.last("payload_reads_cache"))
        result.figures["payload_reads_log"] = int(self.metrics.last("payload_reads_log"))
        result.figures["cache_counted_peak_mib"] = round(
            self.metrics.peak("delay_sidecar_payload_cache_bytes") / 2**20, 1
        )
        result.figures["cache_disk_peak_mib"] = round(self.cache_disk_peak / 2**20, 1)
        if code not in (0, None):
            result.notes.append(f"sidecar exited with code {code}; log: {self.child.log}")
        if self.profiler is not None:
            self.profiler.process.wait(60)
            result.figures["profile"] = str(self.profile_path)


def _outbound(topic: str) -> list[str]:
    return [f"{topic}.{s}" for s in SUBSCRIPTIONS]


def _lateness(ctx: Context, result: Result, topics: list[str]) -> Deliveries:
    deliveries = Deliveries()
    for topic in topics:
        read_deliveries(ctx.bootstrap, topic, ctx.wm(), deliveries)
    delivered = np.frombuffer(deliveries.delivered_ms, dtype=np.int64)
    due = np.frombuffer(deliveries.deliver_at_ms, dtype=np.int64)
    if len(due) == 0:
        result.notes.append("no outbound record carried delay-deliver-at")
        return deliveries
    late = delivered - due
    result.figures.update(
        lateness_p50_ms=float(np.percentile(late, 50)),
        lateness_p99_ms=float(np.percentile(late, 99)),
        lateness_max_ms=int(late.max()),
        early_records=int((late < 0).sum()),
        lateness_read=len(late),
    )
    first_due = int(due.min())
    second = (due - first_due) // 1000
    order = np.argsort(second, kind="stable")
    second, late_sorted = second[order], late[order]
    bounds = np.flatnonzero(np.diff(second)) + 1
    series: dict[str, list[float]] = {"second": [], "p50_ms": [], "p99_ms": [], "max_ms": [], "count": []}
    for chunk_s, chunk in zip(np.split(second, bounds), np.split(late_sorted, bounds), strict=True):
        series["second"].append(float(chunk_s[0]))
        series["p50_ms"].append(float(np.percentile(chunk, 50)))
        series["p99_ms"].append(float(np.percentile(chunk, 99)))
        series["max_ms"].append(float(chunk.max()))
        series["count"].append(float(len(chunk)))
    result.series = series
    return deliveries


def _delivery_rate(result: Result, deliveries: Deliveries, records: int) -> float | None:
    """Records/s per subscription from the first delivery to the last, and the peak one-second rate."""
    delivered = np.frombuffer(deliveries.delivered_ms, dtype=np.int64)
    if len(delivered) < 2:
        return None
    span_s = (int(delivered.max()) - int(delivered.min())) / 1000
    per_second = np.bincount((delivered - delivered.min()) // 1000)
    result.figures["delivery_peak_1s_per_sub"] = int(per_second.max()) // len(SUBSCRIPTIONS)
    result.figures["delivery_span_s"] = round(span_s, 2)
    return records / span_s if span_s > 0 else None


def _finish(result: Result, progress_counts: dict[str, int], records: int) -> None:
    result.delivered = progress_counts
    result.completed = bool(progress_counts) and all(n >= records for n in progress_counts.values())
    extra = {t: n - records for t, n in progress_counts.items() if n > records}
    if extra:
        # In exactly-once mode each transaction also leaves a commit marker, which takes an offset.
        result.notes.append(f"high watermarks past the records produced (duplicates, or commit markers): {extra}")


# ----------------------------------------------------------------------------------------- scenarios


def ceiling(ctx: Context) -> Result:
    n = ctx.sizes.ceiling
    result = Result("ceiling", n, 1)
    inbound = ctx.topic("ceiling")
    outbound = f"{inbound}.out"
    create_topic(ctx.bootstrap, outbound, ctx.sizes.partitions)
    load = run_load(load_argv(ctx.bootstrap, inbound, n), ctx.log("ceiling-load"))
    result.figures["produce_rate"] = round(load["rate"])
    started = time.monotonic()
    relay = start_relay(ctx.bootstrap, inbound, outbound, f"bench-relay-{uuid.uuid4().hex[:6]}", ctx.log("relay"))
    rss = RssSampler(relay.pid).start()
    progress = wait_for_outbound(ctx.wm(), [outbound], n, timeout_s=120 + n / 5_000, alive=relay.alive)
    relay.stop()
    result.figures["peak_rss_mib"] = round(rss.stop(), 1)
    _finish(result, progress.counts, n)
    if progress.first_s is not None and progress.done_s is not None and progress.done_s > progress.first_s:
        rate = n / (progress.done_s - progress.first_s)
        result.figures["delivery_rate_per_sub"] = round(rate)
        result.figures["startup_s"] = round(progress.first_s - started, 2)
        ctx.ceiling_rate = rate
        result.figures["x_ceiling"] = 1.0
    return result


def passthrough(ctx: Context) -> Result:
    n = ctx.sizes.passthrough
    result = Result("passthrough", n, len(SUBSCRIPTIONS))
    inbound = ctx.topic("pass")
    load = run_load(load_argv(ctx.bootstrap, inbound, n), ctx.log("passthrough-load"))
    result.figures["produce_rate"] = round(load["rate"])
    sidecar = _Sidecar(ctx, "passthrough", inbound)
    try:
        progress = wait_for_outbound(
            ctx.wm(), _outbound(inbound), n, timeout_s=120 + n / 2_000, alive=sidecar.child.alive
        )
    finally:
        sidecar.stop(result)
    _finish(result, progress.counts, n)
    result.figures["index_rate"] = _round(sidecar.metrics.rate("delay_sidecar_messages_in_total", n))
    if progress.first_s is not None and progress.done_s is not None and progress.done_s > progress.first_s:
        rate = n / (progress.done_s - progress.first_s)
        result.figures["delivery_rate_per_sub"] = round(rate)
        result.figures["x_ceiling"] = _round(ctx.ratio(rate), 3)
        result.figures["startup_s"] = round(progress.first_s - sidecar.started, 2)
    return result


def _delayed_run(
    ctx: Context,
    name: str,
    n: int,
    base_ms: int,
    window_ms: int,
    load_log: str,
    fixed_delay_ms: int = 0,
    extra: tuple[str, ...] = (),
) -> tuple[Result, Deliveries | None]:
    """Pre-produce (deliver-at headers) or produce live (fixed delay), run the sidecar until all are out."""
    result = Result(name, n, len(SUBSCRIPTIONS))
    inbound = ctx.topic(name)
    if not fixed_delay_ms:
        load = run_load(load_argv(ctx.bootstrap, inbound, n, "deliver-at", base_ms, window_ms), ctx.log(load_log))
        result.figures["produce_rate"] = round(load["rate"])
    sidecar = _Sidecar(ctx, name, inbound, fixed_delay_ms, extra)
    try:
        if fixed_delay_ms:
            # Live: the producer runs beside the sidecar; records fall due fixed_delay after publish.
            process = start_load(load_argv(ctx.bootstrap, inbound, n), ctx.log(load_log))
            load = finish_load(process)
            result.figures["produce_rate"] = round(load["rate"])
            due_end_ms = int(load["end_ms"]) + fixed_delay_ms
        else:
            due_end_ms = base_ms + window_ms
        timeout_s = max(due_end_ms - now_ms(), 0) / 1000 + 60 + n / 5_000
        progress = wait_for_outbound(
            ctx.wm(),
            _outbound(inbound),
            n,
            timeout_s=timeout_s,
            alive=sidecar.child.alive,
            tick=sidecar.sample_cache_disk,
        )
    finally:
        sidecar.stop(result)
    _finish(result, progress.counts, n)
    result.figures["index_rate"] = _round(sidecar.metrics.rate("delay_sidecar_messages_in_total", n))
    delayed = sidecar.metrics.last("delay_sidecar_messages_delayed_total")
    result.figures["indexed_before_due"] = _round(delayed / n, 4)
    if delayed < n:
        result.notes.append(f"{n - int(delayed)} records were already due when the sidecar read them")
    if not result.completed:
        return result, None
    deliveries = _lateness(ctx, result, _outbound(inbound))
    rate = _delivery_rate(result, deliveries, n)
    result.figures["delivery_rate_per_sub"] = _round(rate)
    result.figures["x_ceiling"] = _round(ctx.ratio(rate), 3)
    result.figures["due_rate"] = round(n / (window_ms / 1000)) if window_ms else None
    return result, deliveries


def delayed(ctx: Context, name: str = "delayed", extra: tuple[str, ...] = ()) -> Result:
    sizes = ctx.sizes
    n = sizes.delayed
    base_ms = now_ms() + sizes.lead_ms(n)
    result, _ = _delayed_run(ctx, name, n, base_ms, sizes.window_ms, f"{name}-load", extra=extra)
    result.figures["window_s"] = sizes.window_ms / 1000
    return result


def delayed_nocache(ctx: Context) -> Result:
    return delayed(ctx, "delayed-nocache", NO_CACHE)


def burst(ctx: Context) -> Result:
    sizes = ctx.sizes
    n = sizes.burst
    base_ms = now_ms() + sizes.lead_ms(n)
    result, deliveries = _delayed_run(ctx, "burst", n, base_ms, 1000, "burst-load")
    if deliveries is not None and len(deliveries.delivered_ms):
        first_due = min(deliveries.deliver_at_ms)
        result.figures["drain_s"] = round((max(deliveries.delivered_ms) - first_due) / 1000, 2)
    return result


def fixed(ctx: Context) -> Result:
    sizes = ctx.sizes
    result, deliveries = _delayed_run(
        ctx, "fixed", sizes.fixed, 0, 0, "fixed-load", fixed_delay_ms=sizes.fixed_delay_ms
    )
    result.figures["fixed_delay_s"] = sizes.fixed_delay_ms / 1000
    if deliveries is not None and len(deliveries.deliver_at_ms):
        due = np.frombuffer(deliveries.deliver_at_ms, dtype=np.int64)
        span_s = (int(due.max()) - int(due.min())) / 1000
        result.figures["due_rate"] = round(sizes.fixed / span_s) if span_s > 0 else None
    return result


RUNNERS: dict[str, Callable[[Context], Result]] = {
    "ceiling": ceiling,
    "passthrough": passthrough,
    "delayed": delayed,
    "burst": burst,
    "fixed": fixed,
    "delayed-nocache": delayed_nocache,
}


def _round(value: float | None, digits: int = 0) -> float | None:
    if value is None:
        return None
    return round(value, digits) if digits else float(round(value))
