"""The end-to-end scenarios. Each one uses fresh topics and a fresh consumer group on the shared broker.

Throughput of the relays and pass-through is timed from the first record on the outbound topics to the
last (high watermarks polled every 50 ms, 10 ms for the relays, counting from the records already there
at the first poll), so process start-up and the group join are left out; they are reported separately.
Lateness is read from the outbound topics after the run: record timestamp (set by the sidecar's
producer when it delivers) minus the `delay-deliver-at` header.

Every sidecar rate is set against two relays measured in the same run: the bare ceiling (one output
per input) and the same-I/O relay `relay-2` (one output per input and subscription, headers copied),
which is what issue 13's targets are expressed in (bench/relays.py). Run them first: later scenarios
read their rates from the Context (bench/context.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.context import SUBSCRIPTIONS, Context, Result, finish, rounded
from bench.load import VALUE_BYTES
from bench.probe import (
    Deliveries,
    MetricsRecorder,
    RssSampler,
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
    start_sidecar,
)
from bench.relays import ceiling, relay_2, relay_2_headers
from sidecar.broker.ports import free_port

# Issue 13's set; the relays first, since every later scenario is reported as a ratio to them.
SCENARIOS = (
    "ceiling",
    "relay-2",
    "relay-2-headers",
    "passthrough",
    "delayed",
    "delayed-small-cache",
    "fixed-40k",
    "fixed",
    "burst",
)
# Run only when named, for comparisons in one run (issue 42): the delayed and burst scenarios without
# the payload cache (payloads read back from the log, ahead of time), and without it and the read-ahead
# (read back only when due). (Issue 42 compared the fixed-delay scenarios with monotone runs too,
# fixed-40k-runs and fixed-runs; runs lost, and were removed.) And the delayed and fixed scenarios
# on a keyed topic (issue 50), against the same scenarios without keys.
EXTRA_SCENARIOS = (
    "delayed-keyed",
    "fixed-40k-keyed",
    "delayed-nocache",
    "delayed-bare",
    "burst-nocache",
    "burst-bare",
)
NO_CACHE = ("--payload-cache-bytes", "0")
BARE = (*NO_CACHE, "--read-ahead-ms", "0")
SMALL_CACHE_SHARE = 0.10
"""delayed-small-cache: the cache budget as a share of the data, so most payloads take the read-back path."""
RECORD_OVERHEAD_BYTES = 80
"""Key, deliver-at header and per-entry overhead added to each value when sizing the data (an estimate)."""


def data_bytes(records: int, value_bytes: int = VALUE_BYTES) -> int:
    """The payload data of a run: records x (value bytes + RECORD_OVERHEAD_BYTES)."""
    return records * (value_bytes + RECORD_OVERHEAD_BYTES)


def _policies(ctx: Context, name: str, topic: str, fixed_delay_ms: int = 0, keyed: bool = False) -> Path:
    settings = [f"fixed_delivery_delay: {fixed_delay_ms}ms"] if fixed_delay_ms else []
    settings += ["by_key: replace"] if keyed else []
    delayed = "".join(f"    delayed_delivery:\n      {line}\n" for line in settings[:1])
    delayed += "".join(f"      {line}\n" for line in settings[1:])
    subs = "".join(f"      {s}: {{}}\n" for s in SUBSCRIPTIONS)
    path = ctx.workdir / f"{name}-policies.yaml"
    path.write_text(f"topics:\n  {topic}:\n{delayed}    subscriptions:\n{subs}")
    return path


class _Sidecar:
    """The sidecar process with its memory sampler, metrics recorder and optional profiler."""

    def __init__(
        self,
        ctx: Context,
        name: str,
        topic: str,
        fixed_delay_ms: int = 0,
        extra: tuple[str, ...] = (),
        keyed: bool = False,
    ) -> None:
        self.port = free_port()
        self.started = time.monotonic()
        self.state_dir = ctx.workdir / f"{name}-state"
        self.cache_disk_peak = 0
        self.child = start_sidecar(
            ctx.bootstrap,
            _policies(ctx, name, topic, fixed_delay_ms, keyed),
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
        # Whether the read-back path was exercised at all: records due within --read-ahead-ms of their
        # intake stay in memory, so at small sizes even a tiny cache budget leaves the log unread.
        result.figures["read_back_share"] = round(result.figures["payload_reads_log"] / result.records, 3)
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
    # Seconds, unless everything fell due within a few (fixed at full speed, the burst): one point
    # per second would then be one or two points, a chart with no line.
    bucket_ms = 1000 if int(due.max()) - first_due >= 10_000 else 100
    result.figures["lateness_bucket_s"] = bucket_ms / 1000
    second = (due - first_due) // bucket_ms
    order = np.argsort(second, kind="stable")
    second, late_sorted = second[order], late[order]
    bounds = np.flatnonzero(np.diff(second)) + 1
    series: dict[str, list[float]] = {"second": [], "p50_ms": [], "p99_ms": [], "max_ms": [], "count": []}
    for chunk_s, chunk in zip(np.split(second, bounds), np.split(late_sorted, bounds), strict=True):
        series["second"].append(float(chunk_s[0]) * bucket_ms / 1000)
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


# ----------------------------------------------------------------------------------------- scenarios


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
    finish(result, progress.counts, n)
    result.figures["index_rate"] = rounded(sidecar.metrics.rate("delay_sidecar_messages_in_total", n))
    rate = progress.rate(n)
    if rate is not None and progress.first_s is not None:
        result.figures["delivery_rate_per_sub"] = round(rate)
        ctx.ratios(result, rate)
        if ctx.floor_rate:  # what pass-through is set against: the contract's floor (bench/relays.py)
            result.figures["x_contract_floor"] = round(rate / ctx.floor_rate, 3)
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
    rate: float = 0.0,
    keyed: bool = False,
) -> tuple[Result, Deliveries | None]:
    """Pre-produce (deliver-at headers) or produce live (fixed delay, at `rate`/s or 0: full speed),
    run the sidecar until all are out."""
    result = Result(name, n, len(SUBSCRIPTIONS))
    inbound = ctx.topic(name)
    if not fixed_delay_ms:
        load = run_load(load_argv(ctx.bootstrap, inbound, n, "deliver-at", base_ms, window_ms), ctx.log(load_log))
        result.figures["produce_rate"] = round(load["rate"])
    sidecar = _Sidecar(ctx, name, inbound, fixed_delay_ms, extra, keyed)
    try:
        if fixed_delay_ms:
            # Live: the producer runs beside the sidecar; records fall due fixed_delay after publish.
            process = start_load(load_argv(ctx.bootstrap, inbound, n, rate=rate), ctx.log(load_log))
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
    finish(result, progress.counts, n)
    result.figures["index_rate"] = rounded(sidecar.metrics.rate("delay_sidecar_messages_in_total", n))
    delayed = sidecar.metrics.last("delay_sidecar_messages_delayed_total")
    result.figures["indexed_before_due"] = rounded(delayed / n, 4)
    if delayed < n:
        result.notes.append(f"{n - int(delayed)} records were already due when the sidecar read them")
    if not result.completed:
        return result, None
    deliveries = _lateness(ctx, result, _outbound(inbound))
    delivery_rate = _delivery_rate(result, deliveries, n)
    result.figures["delivery_rate_per_sub"] = rounded(delivery_rate)
    ctx.ratios(result, delivery_rate)
    result.figures["due_rate"] = round(n / (window_ms / 1000)) if window_ms else None
    return result, deliveries


def delayed(ctx: Context, name: str = "delayed", extra: tuple[str, ...] = (), keyed: bool = False) -> Result:
    """`keyed`: the topic has `by_key: replace`. The load's keys are all distinct, so nothing is
    replaced and every record is delivered: the keyed step's whole cost, and its clock gate's
    effect on lateness, against `delayed` in the same run."""
    sizes = ctx.sizes
    n = sizes.delayed
    base_ms = now_ms() + sizes.lead_ms(n)
    result, _ = _delayed_run(ctx, name, n, base_ms, sizes.window_ms, f"{name}-load", extra=extra, keyed=keyed)
    result.figures["window_s"] = sizes.window_ms / 1000
    return result


def delayed_nocache(ctx: Context) -> Result:
    return delayed(ctx, "delayed-nocache", NO_CACHE)


def delayed_small_cache(ctx: Context) -> Result:
    """The read-back path: a cache budget of SMALL_CACHE_SHARE of the data, so most payloads come from the log."""
    budget = int(SMALL_CACHE_SHARE * data_bytes(ctx.sizes.delayed))
    result = delayed(ctx, "delayed-small-cache", ("--payload-cache-bytes", str(budget)))
    result.figures["cache_budget_mib"] = round(budget / 2**20, 2)
    share = result.figures.get("read_back_share", 0.0)
    if share < 0.5:
        result.notes.append(
            f"only {share:.0%} of payloads were read back from the log: most fell due within --read-ahead-ms "
            "of their intake and stayed in memory, so this run says little about the read-back path"
        )
    return result


def burst(ctx: Context, name: str = "burst", extra: tuple[str, ...] = ()) -> Result:
    sizes = ctx.sizes
    n = sizes.burst
    base_ms = now_ms() + sizes.lead_ms(n)
    result, deliveries = _delayed_run(ctx, name, n, base_ms, 1000, f"{name}-load", extra=extra)
    if deliveries is not None and len(deliveries.delivered_ms):
        first_due = min(deliveries.deliver_at_ms)
        result.figures["drain_s"] = round((max(deliveries.delivered_ms) - first_due) / 1000, 2)
    return result


def fixed(
    ctx: Context, name: str = "fixed", rate: float = 0.0, extra: tuple[str, ...] = (), keyed: bool = False
) -> Result:
    """A fixed-delay topic fed live, at full speed (rate 0) or at `rate` records/s; `keyed` as in `delayed`."""
    sizes = ctx.sizes
    result, deliveries = _delayed_run(
        ctx,
        name,
        sizes.fixed,
        0,
        0,
        f"{name}-load",
        fixed_delay_ms=sizes.fixed_delay_ms,
        extra=extra,
        rate=rate,
        keyed=keyed,
    )
    result.figures["fixed_delay_s"] = sizes.fixed_delay_ms / 1000
    if rate:
        result.figures["target_produce_rate"] = round(rate)
    if deliveries is not None and len(deliveries.deliver_at_ms):
        due = np.frombuffer(deliveries.deliver_at_ms, dtype=np.int64)
        span_s = (int(due.max()) - int(due.min())) / 1000
        result.figures["due_rate"] = round(sizes.fixed / span_s) if span_s > 0 else None
    return result


def fixed_paced(ctx: Context) -> Result:
    return fixed(ctx, "fixed-40k", ctx.sizes.fixed_rate)


RUNNERS: dict[str, Callable[[Context], Result]] = {
    "ceiling": ceiling,
    "relay-2": relay_2,
    "relay-2-headers": relay_2_headers,
    "passthrough": passthrough,
    "delayed": delayed,
    "delayed-small-cache": delayed_small_cache,
    "fixed-40k": fixed_paced,
    "fixed": fixed,
    "burst": burst,
    "delayed-keyed": lambda ctx: delayed(ctx, "delayed-keyed", keyed=True),
    "fixed-40k-keyed": lambda ctx: fixed(ctx, "fixed-40k-keyed", ctx.sizes.fixed_rate, keyed=True),
    "delayed-nocache": delayed_nocache,
    "delayed-bare": lambda ctx: delayed(ctx, "delayed-bare", BARE),
    "burst-nocache": lambda ctx: burst(ctx, "burst-nocache", NO_CACHE),
    "burst-bare": lambda ctx: burst(ctx, "burst-bare", BARE),
}
