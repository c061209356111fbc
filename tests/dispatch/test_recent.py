"""RecentRecords: what intake read last, found by offset without the log; the oldest leave first."""

import sys

from confluent_kafka import Message
from hypothesis import given
from hypothesis import strategies as st

from sidecar.dispatch.recent import RECORD_OVERHEAD, RecentRecords

P = ("orders", 0)
Q = ("orders", 1)


def records(offsets: list[int], size: int = 100) -> list[Message]:
    return [Message(topic=P[0], partition=P[1], offset=o, value=b"v" * size) for o in offsets]


def per_record(size: int = 100) -> int:
    return size + RECORD_OVERHEAD


def test_kept_records_are_found_and_the_rest_is_left_for_the_log() -> None:
    recent = RecentRecords(1 << 20)
    recent.keep(P, records([10, 11, 12]))
    recent.keep(P, records([13, 15, 16]))  # a gap: a transaction marker at 14
    found, missing = recent.take({P: [9, 11, 14, 15, 17], Q: [3]})
    assert [(p, o, m.offset()) for p, o, m in found] == [(P, 11, 11), (P, 15, 15)]
    assert missing == {P: [9, 14, 17], Q: [3]}


def test_the_oldest_slices_leave_first_once_the_budget_is_spent() -> None:
    recent = RecentRecords(5 * per_record())
    recent.keep(P, records([0, 1, 2]))
    recent.keep(Q, records([0, 1]))
    assert recent.bytes == 5 * per_record()
    recent.keep(P, records([3]))  # over by one record: the oldest slice goes, whole
    assert recent.bytes == 3 * per_record()
    found, missing = recent.take({P: [0, 3], Q: [1]})
    assert [(p, o) for p, o, _ in found] == [(P, 3), (Q, 1)]
    assert missing == {P: [0]}


def test_a_slice_larger_than_the_budget_and_a_zero_budget_keep_nothing() -> None:
    recent = RecentRecords(2 * per_record())
    recent.keep(P, records([0, 1, 2]))
    assert recent.bytes == 0
    off = RecentRecords(0)
    off.keep(P, records([0]))
    assert off.take({P: [0]}) == ([], {P: [0]})


def test_a_forgotten_partition_is_read_from_the_log_and_frees_its_budget() -> None:
    recent = RecentRecords(1 << 20)
    recent.keep(P, records([0, 1]))
    recent.keep(Q, records([0]))
    recent.forget(P)
    assert recent.bytes == per_record()
    assert recent.take({P: [0]}) == ([], {P: [0]})
    recent.keep(P, records([0]))  # assigned again later: kept afresh
    assert [o for _, o, _ in recent.take({P: [0]})[0]] == [0]


def test_a_partition_read_again_from_further_back_starts_over() -> None:
    recent = RecentRecords(1 << 20)
    recent.keep(P, records([5, 6, 7]))
    recent.keep(P, records([3, 4]))  # a seek back: what was kept after it is no longer in order
    found, missing = recent.take({P: [3, 6]})
    assert [o for _, o, _ in found] == [3]
    assert missing == {P: [6]}
    assert recent.bytes == 2 * per_record()


@given(
    st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=6), min_size=1, max_size=200),
    st.integers(0, 200),
    st.lists(st.integers(0, 400), max_size=40),
)
def test_every_offset_is_found_once_with_its_own_record_or_left_for_the_log(
    steps: list[list[int]], budget_records: int, wanted: list[int]
) -> None:
    """Slices with gaps of 1 to 3 offsets, over any budget: a found record is the one at that
    offset, the found and the missing together are exactly what was asked, and the newest records
    (those the budget holds) are always found."""
    recent = RecentRecords(budget_records * per_record())
    offset, kept_offsets = 0, []
    for gaps in steps:
        chunk = []
        for gap in gaps:
            offset += gap
            chunk.append(offset)
        recent.keep(P, records(chunk))
        kept_offsets.append(chunk)
    asked = sorted(set(wanted))
    found, missing = recent.take({P: asked})
    assert all(m.offset() == o for _, o, m in found)
    assert sorted([o for _, o, _ in found] + missing.get(P, [])) == asked
    assert recent.bytes <= budget_records * per_record()
    newest: list[int] = []
    for chunk in reversed(kept_offsets):  # whole slices, newest first, while they fit
        if len(newest) + len(chunk) > budget_records:
            break
        newest += chunk
    assert {o for o in asked if o in newest} <= {o for _, o, _ in found}


def test_a_slice_that_ages_out_is_let_go_at_once() -> None:
    """Its records are freed when it leaves the budget, not when the front of the list is cut."""
    recent = RecentRecords(2 * per_record())
    first = records([0])
    baseline = sys.getrefcount(first)
    recent.keep(P, first)
    assert sys.getrefcount(first) > baseline
    recent.keep(P, records([1]))
    recent.keep(P, records([2]))  # over the budget: the slice of offset 0 goes
    assert sys.getrefcount(first) == baseline
