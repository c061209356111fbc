from sidecar.dispatch.ranges import OffsetRange, offset_ranges


def test_close_offsets_are_read_through_and_far_ones_start_a_range() -> None:
    assert offset_ranges([], 10) == []
    assert offset_ranges([5], 10) == [OffsetRange(5, 5)]
    assert offset_ranges([1, 2, 12, 30, 31, 100], 10) == [
        OffsetRange(1, 12),
        OffsetRange(30, 31),
        OffsetRange(100, 100),
    ]
