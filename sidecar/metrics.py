"""Prometheus metrics (contract section 7), built once against a registry passed in.

The flow calls these objects directly, but counts per batch where it can: a labelled counter
costs a dictionary lookup and a lock, which matters at hundreds of thousands of records a second.
"""

import bisect
import math
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "delay_sidecar_"

# Lateness after deliver-at: the target is a p99 under 50 ms, so resolution is finest below 100 ms;
# the tail reaches minutes to show a sidecar that fell behind.
LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Snapshot operations are RocksDB writes and reads: microseconds to a second.
OP_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.messages_in = Counter(PREFIX + "messages_in", "Inbound records read", ["topic"], registry=r)
        self.messages_delayed = Counter(
            PREFIX + "messages_delayed", "Inbound records indexed for later delivery", ["topic"], registry=r
        )
        self.rejected = Counter(
            PREFIX + "messages_delayed_rejected",
            "Inbound records sent to the dead-letter topic",
            ["topic", "namespace", "code"],
            registry=r,
        )
        self.fixed_delay_overridden = Counter(
            PREFIX + "messages_fixed_delay_overridden",
            "Records whose delay header was replaced by a fixed delivery delay",
            ["topic", "namespace"],
            registry=r,
        )
        self.delay_disabled = Counter(
            PREFIX + "messages_delay_disabled",
            "Records that asked for a delay on a topic whose delayed delivery is disabled",
            ["topic", "namespace"],
            registry=r,
        )
        self.delay_header_miscased = Counter(
            PREFIX + "delay_header_miscased",
            "Records with a header like Deliver-At: header names are case-sensitive, so it was not applied",
            ["topic"],
            registry=r,
        )
        self.delivered = Counter(
            PREFIX + "messages_delivered",
            "Records written to a subscription's outbound topic",
            ["topic", "subscription"],
            registry=r,
        )
        self.replaced = Counter(
            PREFIX + "messages_replaced",
            "Pending records of keyed topics that a newer record for their key replaced (a tombstone: cancelled); "
            "a rebuild counts again the ones it reads again",
            ["topic"],
            registry=r,
        )
        self.replayed = Counter(
            PREFIX + "messages_replayed",
            "Inbound records read again to rebuild an index that did not survive a restart",
            ["topic"],
            registry=r,
        )
        self.lost = Counter(
            PREFIX + "messages_lost",
            "Due records that were no longer in the inbound log (deleted by retention)",
            ["topic"],
            registry=r,
        )
        self.payload_reads = Counter(
            PREFIX + "payload_reads",
            "Payloads of due records fetched before delivery, by source: the local payload cache (cache), the "
            "inbound log read back by offset (log), or the records kept for redeliveries (recent)",
            ["topic", "source"],
            registry=r,
        )
        self.payload_cache_bytes = Gauge(
            PREFIX + "payload_cache_bytes",
            "Bytes in the local payload cache, as counted against --payload-cache-bytes (before compression)",
            registry=r,
        )
        self.lateness = Histogram(
            PREFIX + "delivery_lateness_seconds",
            "Time from effective deliver-at to the write of a delayed record or of a nack's redelivery",
            ["topic"],
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        self.tracked = Gauge(PREFIX + "tracked_messages", "Delayed records indexed, not yet due", ["topic"], registry=r)
        self.pending_due = Gauge(
            PREFIX + "pending_due",
            "Delayed records pending that fall due within the next minute, hour, day, or at all",
            ["topic", "within"],
            registry=r,
        )
        self.nacks = Counter(PREFIX + "nack", "Nack commands by result", ["subscription", "result"], registry=r)
        self.commands = Counter(
            PREFIX + "commands",
            "Cancel and reschedule commands by outcome",
            ["type", "outcome"],
            registry=r,
        )
        self.redeliveries = Counter(
            PREFIX + "redeliveries", "Records redelivered after a nack", ["subscription"], registry=r
        )
        self.policy_reloads = Counter(PREFIX + "policy_reloads", "Policy reloads by result", ["result"], registry=r)
        self.policy_generation = Gauge(PREFIX + "policy_generation", "Policy generation in force", registry=r)
        self.engine_restarts = Counter(
            PREFIX + "engine_restarts", "Times the engine failed and started again from the last checkpoint", registry=r
        )
        self.handoffs = Counter(
            PREFIX + "partition_handoffs",
            "Partitions this member was given (assigned), gave back with a checkpoint (revoked) or lost without one "
            "(lost) in a rebalance of its consumer group",
            ["event"],
            registry=r,
        )
        for event in ("assigned", "revoked", "lost"):
            self.handoffs.labels(event)
        self.owned_partitions = Gauge(
            PREFIX + "assigned_partitions", "Partitions (inbound and control) this member owns now", registry=r
        )
        self.state_restores = Counter(
            PREFIX + "state_restores",
            "Partitions taken over without usable local state: their index loaded from the state topic "
            "(state-topic), or rebuilt from the earliest pending record because the state topic had none (replay)",
            ["result"],
            registry=r,
        )
        for result in ("state-topic", "replay"):
            self.state_restores.labels(result)
        self.state_records = Counter(
            PREFIX + "state_records",
            "Records written to the state topic (snapshots, manifests, tombstones)",
            registry=r,
        )
        self.commits = Counter(PREFIX + "commits", "Checkpoints that committed inbound offsets", registry=r)
        self.checkpoint_latency = Histogram(
            PREFIX + "checkpoint_seconds",
            "Time a checkpoint takes on the loop (flush, index writes, and in exactly-once mode the index fsync "
            "and the transaction commit); the loop delivers nothing meanwhile",
            buckets=OP_BUCKETS,
            registry=r,
        )
        self.gc_pauses = Histogram(
            PREFIX + "gc_full_collection_seconds",
            "Full passes of Python's garbage collector, by reason (idle: between deliveries; due: the longest "
            "interval ran out under load); the loop delivers nothing meanwhile",
            ["reason"],
            buckets=OP_BUCKETS,
            registry=r,
        )
        self.buckets = Gauge(PREFIX + "bucket_count", "Buckets of the delayed index", ["topic"], registry=r)
        self.loaded_indexes = Gauge(
            PREFIX + "bucket_loaded_indexes", "Index entries held in memory", ["topic"], registry=r
        )
        self.snapshot_bytes = Gauge(
            PREFIX + "bucket_snapshot_bytes", "Bytes of bucket snapshots", ["topic"], registry=r
        )
        self.bucket_ops = Counter(
            PREFIX + "bucket_op", "Snapshot operations by type and state", ["type", "state"], registry=r
        )
        self.bucket_op_latency = Histogram(
            PREFIX + "bucket_op_latency_seconds",
            "Snapshot operation latency",
            ["type"],
            buckets=OP_BUCKETS,
            registry=r,
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), cached: the hot paths count per batch without a lookup and a lock."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe_many(self, histogram: Any, values: Sequence[float]) -> None:
        """`histogram.observe(v)` for each of `values` (a labelled child), with one lock per bucket touched.

        Observing one delivery at a time took 6% of a burst's profile. This reaches into
        prometheus_client's Histogram (`_upper_bounds`, `_buckets`, `_sum`, unchanged since 0.4);
        without them it observes one by one."""
        if not values:
            return
        bounds = getattr(histogram, "_upper_bounds", None)
        buckets = getattr(histogram, "_buckets", None)
        total = getattr(histogram, "_sum", None)
        if bounds is None or buckets is None or total is None:
            for value in values:
                histogram.observe(value)
            return
        counts = [0] * len(bounds)
        left = bisect.bisect_left
        for value in values:
            counts[left(bounds, value)] += 1  # the first bound >= value, as observe() picks it
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
        total.inc(sum(values))

    def observe_lateness(self, histogram: Any, now_ms: int, deliver_ats: Sequence[int]) -> None:
        """`observe_many` of each delivery's lateness, `max(now_ms - deliver_at, 0)` in seconds, for
        deliver-ats in ascending order (as the tracker pops them): each bucket's count is found by
        bisecting them, not by a pass over the records. A burst delivers tens of thousands per call."""
        n = len(deliver_ats)
        bounds = getattr(histogram, "_upper_bounds", None)
        buckets = getattr(histogram, "_buckets", None)
        total = getattr(histogram, "_sum", None)
        if not n or bounds is None or buckets is None or total is None:
            self.observe_many(histogram, [max(now_ms - d, 0) / 1000 for d in deliver_ats])
            return
        left = bisect.bisect_left
        below = 0  # deliveries whose lateness is at most the previous bound
        for bucket, bound in zip(buckets, bounds, strict=True):
            # lateness <= bound  <=>  deliver_at >= now - (the most whole ms that observe() puts there)
            within = n if bound == math.inf else n - left(deliver_ats, now_ms - _most_ms_within(bound))
            if within > below:
                bucket.inc(within - below)
                below = within
        late = left(deliver_ats, now_ms)  # those with deliver_at < now are late by something
        if late:
            total.inc((late * now_ms - sum(deliver_ats[:late])) / 1000)

    def export_topics(self, topics: list[str]) -> None:
        """Export each topic's counters at 0 from the start: a scrape can tell "none yet" from "not served"."""
        for topic in topics:
            for metric in (self.messages_in, self.messages_delayed, self.replayed, self.lost):
                self.child(metric, topic)
            for source in ("cache", "log", "recent"):
                self.child(self.payload_reads, topic, source)


def _most_ms_within(bound: float) -> int:
    """The largest whole number of milliseconds L with L / 1000 <= bound, compared as observe()
    compares a lateness with a bucket's bound (in float seconds)."""
    most = math.floor(bound * 1000)
    while (most + 1) / 1000 <= bound:
        most += 1
    while most / 1000 > bound:
        most -= 1
    return most


class BucketMetrics:
    """The bucket tracker's storage operations, and the checkpoint's fsync of its store, as
    Prometheus counts and latencies."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def on_op(self, op: str, ok: bool, seconds: float) -> None:
        self._metrics.bucket_ops.labels(op, "succeed" if ok else "failed").inc()
        self._metrics.bucket_op_latency.labels(op).observe(seconds)
