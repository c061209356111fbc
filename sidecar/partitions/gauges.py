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
        tracked[state.topic] += len(state.tracker) + state.runs.pending
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
