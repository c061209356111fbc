"""The batch observers of Metrics give what observing one value at a time gives."""

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from sidecar.metrics import Metrics


def histogram_state(metrics: Metrics, topic: str) -> tuple[list[float], float]:
    """(cumulative bucket counts, sum) of the lateness histogram of `topic`, as a scrape shows them."""
    [family] = [m for m in metrics.registry.collect() if m.name.endswith("delivery_lateness_seconds")]
    buckets = [s.value for s in family.samples if s.name.endswith("_bucket") and s.labels["topic"] == topic]
    [total] = [s.value for s in family.samples if s.name.endswith("_sum") and s.labels["topic"] == topic]
    return buckets, total


def one_by_one(histogram: Any, now_ms: int, deliver_ats: list[int]) -> None:
    for d in deliver_ats:
        histogram.observe(max(now_ms - d, 0) / 1000)


@given(
    now=st.integers(min_value=0, max_value=2**41),
    offsets=st.lists(st.integers(min_value=-100_000, max_value=100_000), max_size=200),
)
def test_lateness_by_bisection_counts_what_one_observe_per_record_counts(now: int, offsets: list[int]) -> None:
    metrics = Metrics(CollectorRegistry())
    deliver_ats = sorted(now - o for o in offsets)  # late, on time and early (the next test takes the bounds)
    metrics.observe_lateness(metrics.child(metrics.lateness, "batch"), now, deliver_ats)
    one_by_one(metrics.child(metrics.lateness, "single"), now, deliver_ats)
    batch, single = histogram_state(metrics, "batch"), histogram_state(metrics, "single")
    assert batch[0] == single[0]
    assert abs(batch[1] - single[1]) <= 1e-6 * max(1.0, abs(single[1]))


def test_lateness_on_a_bucket_bound_falls_in_that_bucket() -> None:
    metrics = Metrics(CollectorRegistry())
    bounds = metrics.child(metrics.lateness, "t")._upper_bounds
    now = 1_000_000
    lateness = {round(b * 1000) + d for b in bounds if b != float("inf") for d in (-1, 0, 1)}
    deliver_ats = sorted(now - ms for ms in lateness)
    metrics.observe_lateness(metrics.child(metrics.lateness, "batch"), now, deliver_ats)
    one_by_one(metrics.child(metrics.lateness, "single"), now, deliver_ats)
    assert histogram_state(metrics, "batch") == histogram_state(metrics, "single")
