"""Which stretches of a partition to read for a set of due offsets. Pure code.

A seek costs a fetch round trip, so due offsets are sorted and read as ranges: offsets closer
than `max_gap` are read through (the records in between are fetched and dropped), farther ones
start a new range with a seek.
"""

from typing import NamedTuple

# Reading through a gap of this many 100-byte records costs about what one extra fetch round trip
# costs on a local broker; beyond it a seek is cheaper.
DEFAULT_MAX_GAP = 2_000


class OffsetRange(NamedTuple):
    first: int
    last: int


def offset_ranges(sorted_offsets: list[int], max_gap: int = DEFAULT_MAX_GAP) -> list[OffsetRange]:
    ranges: list[OffsetRange] = []
    if not sorted_offsets:
        return ranges
    first = last = sorted_offsets[0]
    for offset in sorted_offsets[1:]:
        if offset - last > max_gap:
            ranges.append(OffsetRange(first, last))
            first = offset
        last = offset
    ranges.append(OffsetRange(first, last))
    return ranges
