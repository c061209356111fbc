"""SealedBuckets.peek_loaded bisects each loaded segment; it must find what a pass over it finds."""

from array import array
from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sidecar.tracker.bucket.buckets import SealedBuckets
from sidecar.tracker.storage.base import KEY_SHIFT


def passed_over(buckets: list[Any], low: int, limit: int) -> list[int]:
    """The definition: every key of a loaded segment from its pop position, above low and below limit."""
    return [
        key
        for b in buckets
        for pos in range(b.pos, len(b.offsets))
        if low < (key := b.at[pos] << KEY_SHIFT | b.offsets[pos]) < limit
    ]


@st.composite
def loaded_segments(draw: st.DrawFn) -> list[Any]:
    buckets = []
    for _ in range(draw(st.integers(0, 4))):
        # Few distinct deliver-ats, so many entries share one (ties on the bisected column).
        keys = sorted(set(draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40)), max_size=30))))
        pos = draw(st.integers(0, len(keys)))
        buckets.append(
            SimpleNamespace(at=array("q", [a for a, _ in keys]), offsets=array("Q", [o for _, o in keys]), pos=pos)
        )
    return buckets


def key(at: int, offset: int) -> int:
    return at << KEY_SHIFT | offset


@given(loaded_segments(), st.data())
def test_peek_loaded_finds_what_a_pass_over_each_segment_finds(buckets: list[Any], data: st.DataObject) -> None:
    keys = [key(a, o) for b in buckets for a, o in zip(b.at, b.offsets, strict=True)]
    # A bound on an entry of a segment is the read-ahead's case: `low` is the last entry it saw.
    bound = st.builds(key, st.integers(0, 14), st.integers(0, 41))
    if keys:
        bound = st.one_of(bound, st.sampled_from(keys))
    low = data.draw(st.one_of(st.just(-1), bound))
    limit = data.draw(bound)
    found: list[int] = []
    SealedBuckets.peek_loaded(SimpleNamespace(buckets=buckets), low, limit, found)  # type: ignore[arg-type]
    assert found == passed_over(buckets, low, limit)
