"""The index as gauges: tracked messages per topic, the bucket metrics, and degraded partitions."""

from collections import Counter
from collections.abc import Iterable

from sidecar.metrics import Metrics
from sidecar.partitions.state import PartitionState
from sidecar.tracker.bucket import BucketTracker

BUCKET_GAUGES = ("buckets", "loaded_indexes", "snapshot_bytes")


def publish_index_gauges(metrics: Metrics, states: Iterable[PartitionState], topics: list[str]) -> list[str]:
    """Set the gauges, summed per topic; returns the partitions whose index storage is failing."""
    tracked: Counter[str] = Counter()
    sums: dict[str, Counter[str]] = {name: Counter() for name in BUCKET_GAUGES}
    degraded = []
    for state in states:
        tracked[state.topic] += len(state.tracker)
        if isinstance(state.tracker, BucketTracker):
            stats = state.tracker.stats()
            for name, counts in sums.items():
                counts[state.topic] += getattr(stats, name)
            if stats.degraded:
                degraded.append(
                    f"{state.name}: index storage failing ({','.join(stats.degraded_ops)}); "
                    "retrying, entries kept in memory"
                )
    for name, counts in sums.items():
        for topic, value in counts.items():
            getattr(metrics, name).labels(topic).set(value)
    for topic in topics:
        metrics.tracked.labels(topic).set(tracked.get(topic, 0))
    return degraded


WITHIN = (("1m", 60_000), ("1h", 3_600_000), ("1d", 86_400_000))


def publish_due_gauges(metrics: Metrics, states: Iterable[PartitionState], topics: list[str], now_ms: int) -> None:
    """How many pending records fall due within the next minute, hour and day, per topic: the first
    question an operator asks of a delay queue. `all` is every pending record."""
    limits = [now_ms + span for _, span in WITHIN]
    sums: dict[str, list[int]] = {topic: [0] * (len(WITHIN) + 1) for topic in topics}
    for state in states:
        if state.control or state.topic not in sums:
            continue
        counts = state.tracker.due_counts(limits)
        total = sums[state.topic]
        for i, n in enumerate(counts):
            total[i] += n
        total[-1] += len(state.tracker)
    for topic, total in sums.items():
        for (label, _), n in zip(WITHIN, total, strict=False):
            metrics.pending_due.labels(topic, label).set(n)
        metrics.pending_due.labels(topic, "all").set(total[-1])
