"""The relays every sidecar rate is set against, run as bench/relay.py processes.

* ceiling: each inbound record to one topic, the leanest relay (the bare ceiling);
* relay-2: each inbound record to one topic per subscription, key, value and headers copied, with the
  same producer settings: the same I/O as the sidecar with its two subscriptions (issue 13's relay).
* relay-2-headers: relay-2 with what the contract asks of every delivery, the inbound partition kept and
  the compact form's two headers. No sidecar that honours the contract in one Python process can pass
  it, so pass-through is also reported against it (`x_contract_floor`).

Their rates are timed from the first outbound record to the last by watermarks (bench/probe.py).
"""

from __future__ import annotations

import time
import uuid

from bench.context import SUBSCRIPTIONS, Context, Result, finish
from bench.probe import RssSampler, create_topic, wait_for_outbound
from bench.procs import load_argv, run_load, start_relay


def _relay(ctx: Context, name: str, outputs: int, contract_headers: bool = False) -> tuple[Result, float | None]:
    """bench/relay.py writing each inbound record to `outputs` topics; its per-topic rate."""
    n = ctx.sizes.ceiling
    result = Result(name, n, outputs)
    inbound = ctx.topic(name)
    outbound = [f"{inbound}.out{i}" for i in range(outputs)]
    for topic in outbound:
        create_topic(ctx.bootstrap, topic, ctx.sizes.partitions)
    load = run_load(load_argv(ctx.bootstrap, inbound, n), ctx.log(f"{name}-load"))
    result.figures["produce_rate"] = round(load["rate"])
    started = time.monotonic()
    group = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    relay = start_relay(ctx.bootstrap, inbound, outbound, group, ctx.log(name), contract_headers)
    rss = RssSampler(relay.pid).start()
    # Polled 5x as often as the sidecar: a relay carries 100,000 records in a few tenths of a second,
    # so 50 ms steps would make its rate, which every target is set against, a guess.
    progress = wait_for_outbound(ctx.wm(), outbound, n, timeout_s=120 + n / 5_000, poll_s=0.01, alive=relay.alive)
    relay.stop()
    result.figures["peak_rss_mib"] = round(rss.stop(), 1)
    finish(result, progress.counts, n)
    rate = progress.rate(n)
    if rate is None or progress.first_s is None:
        result.notes.append("no rate: every record arrived between two watermark polls (too few records)")
        return result, None
    result.figures["delivery_rate_per_sub"] = round(rate)
    result.figures["startup_s"] = round(progress.first_s - started, 2)
    return result, rate


def ceiling(ctx: Context) -> Result:
    result, ctx.ceiling_rate = _relay(ctx, "ceiling", 1)
    ctx.ratios(result, ctx.ceiling_rate)
    return result


def relay_2(ctx: Context) -> Result:
    """The same-I/O relay: as many outputs per input as the sidecar with its two subscriptions."""
    result, ctx.relay_rate = _relay(ctx, "relay-2", len(SUBSCRIPTIONS))
    ctx.ratios(result, ctx.relay_rate)
    if ctx.relay_rate:
        result.figures["same_io_relay_1m_s"] = round(1_000_000 / ctx.relay_rate, 2)
    return result


def relay_2_headers(ctx: Context) -> Result:
    """relay-2 paying the contract's per-delivery cost: the floor for pass-through."""
    result, ctx.floor_rate = _relay(ctx, "relay-2-headers", len(SUBSCRIPTIONS), contract_headers=True)
    ctx.ratios(result, ctx.floor_rate)
    return result
