"""Keyed replacement (`delayed_delivery: {by_key: replace}`): the newest record for a key decides.

The rule must be one that a rebuild from the log decides the same way as the live intake did,
whichever member reads it and from where. So it looks only at the log, and at its clock, the
greatest timestamp of the partition's records so far:

    A record R at offset o for key K replaces K's previous record P (deliver-at T) when, and only
    when, P was delayed and no record of the partition up to o (any key, R included) has a
    timestamp at or past T: the log's clock at R is still before T.

Once the log's clock reaches T, P's time has come: it is delivered, and a later record of K is a
record of its own. The timestamps are those of the log (CreateTime or LogAppendTime), and the
greatest so far, not R's own timestamp, is what counts: a producer whose clock lags cannot put a
record "before" one already past T.

The delivery side keeps the rule true: a keyed partition's entry due at T is delivered only once
the log's clock has reached T (the clock gate), so that any record read later finds the clock past
T and replaces nothing. A partition with no such record gets one written by the sidecar. As the
clock only moves forward, so does the gate: an entry read after the gate passed its time is due at
once, and no record can replace it any more.

A rebuild starts at or below the partition's earliest pending offset with the clock as it stood
there, which the commit records (partitions/metadata.py: `clock`): the records below were all
decided.

No I/O here: the key index is given (RocksDB beside the bucket index in the engine, a dict in the
tests), and so is the order of the records, which is the log's.
"""

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol, cast


class Pending(NamedTuple):
    """A key's newest record, as the key index keeps it."""

    offset: int
    deliver_at: int | None
    """None: not delayed (delivered at once, or a tombstone); nothing of it can be replaced."""


Entry = tuple[int, int | None]
"""A Pending as a plain tuple: the slice's loop builds one per record, and a named tuple costs
twice as much to make."""


class KeyIndex(Protocol):
    """Each key's newest record, read and written a slice of intake at a time: one read and one
    write of the index per slice, not per record (a point read of RocksDB costs more than the rule)."""

    def read(self, keys: Sequence[bytes]) -> list[Entry | None]: ...

    def write(self, entries: Mapping[bytes, Entry]) -> None: ...


class Verdict(NamedTuple):
    replaced: int | None
    """The offset of the key's record that this one replaces, if any."""
    deliver: bool
    """False for a tombstone: it cancels, and is not delivered itself."""


BEFORE_ANY = -1
"""The log's clock before any record, as a commit records it: below every timestamp (the sidecar
reads a record without one as 0). A commit that records a clock says that the partition has keyed
state, which the next owner starts at once, so that it moves the clock with every record from
there, as the earlier owner's did."""

SAMPLE_EVERY = 4_096
"""Offsets between two of the clock's samples: what a commit may record of it (`LogClock.sample`)."""


class LogClock:
    """The log's clock: the greatest timestamp of the partition's records read so far.

    A commit records it at an offset where a rebuild can start (`sample`). Keeping its value at
    every offset would cost memory per record between the earliest pending one and the newest,
    hours of records on a topic with long delays; so it is sampled at the first record read in each
    block of SAMPLE_EVERY offsets, and the commit names the latest sample at or below its earliest
    pending offset, from which a rebuild reads at most that many records more.
    """

    def __init__(self, before: int | None = None) -> None:
        self.now: int | None = before
        """The greatest timestamp read so far; None before any."""
        self._offsets: list[int] = []
        self._before: list[int | None] = []
        """Sampled offsets, ascending, and the clock just before each."""
        self._block = -1

    def note(self, offset: int, timestamp: int) -> None:
        """A record read, in offset order."""
        block = offset // SAMPLE_EVERY
        if block != self._block:
            self._block = block
            self._offsets.append(offset)
            self._before.append(self.now)
        if self.now is None or timestamp > self.now:
            self.now = timestamp

    def sample(self, offset: int) -> tuple[int, int | None] | None:
        """(s, the clock just before s) for the latest sampled offset s at or below `offset`; None
        when none is (nothing read there since this clock started)."""
        i = bisect_right(self._offsets, offset)
        return (self._offsets[i - 1], self._before[i - 1]) if i else None

    def forget_below(self, offset: int) -> None:
        """Nobody will ask `sample` of an offset below this one any more: the latest sample at or
        below it is kept."""
        i = bisect_right(self._offsets, offset) - 1
        if i > 0:
            del self._offsets[:i], self._before[:i]


class KeyStep:
    """The rule applied to one partition's records in offset order, live and in a rebuild alike.

    A rebuild starts at or below the partition's earliest pending offset with the log's clock as it
    stood there (`clock_before`, which the commit records): every record that could still be
    replaced is at or past it. A key whose newest record is below it was decided already (delivered, or
    replaced by a record also below it), so the index may forget it; what it remembers of it is
    never pending by the rule, since the clock gate let it go only once the clock reached its time.
    """

    def __init__(self, index: KeyIndex, clock_before: int | None = None) -> None:
        self.index = index
        self.clock = LogClock(clock_before)
        self.start: int | None = None
        """The first offset this step read. An entry of the index outside [start, the record read)
        was left by an earlier reading of the log (a durable index is not emptied when its owner
        starts again): the records this step read decided every key they hold, and nothing else
        is pending."""

    def note(self, offset: int, timestamp: int) -> None:
        """A record that is not a keyed message: it moves the clock all the same."""
        if self.start is None:
            self.start = offset
        self.clock.note(offset, timestamp)

    def take(self, offset: int, timestamp: int, key: bytes | None, tombstone: bool, deliver_at: int | None) -> Verdict:
        """One record: its timestamp, key, whether its value is null, and its deliver-at (None: due
        at once). A record without a key, or with an empty one, is not keyed: producers place it as
        no key. A dead-lettered record is given without its key: it replaces nothing, and the
        key's pending record stays pending. Every record is noted on the clock."""
        (replaced,) = self.take_many([offset], [timestamp], [key], [tombstone], [deliver_at])
        return Verdict(replaced, not (key and tombstone))

    def take_many(
        self,
        offsets: Sequence[int],
        stamps: Sequence[int],
        keys: Sequence[bytes | None],
        tombstones: Sequence[bool],
        deliver_ats: Sequence[int | None],
    ) -> list[int | None]:
        """`take` of a slice of records in offset order: the offset each one replaces. The index is
        read once for the slice's keys and written once with their newest records; the loop is the
        rule, with LogClock.note inlined (per record, a call costs as much as the rule)."""
        if not offsets:
            return []
        if self.start is None:
            self.start = offsets[0]
        start = self.start
        clock = self.clock
        now = clock.now
        unique = dict.fromkeys(keys)
        unique.pop(None, None)
        unique.pop(b"", None)  # no key, as producers place it
        # In key order: RocksDB's multi-get, and its write of the same keys (`latest` keeps the order),
        # save more than the sort costs (bench/keyed_step.py).
        wanted = cast(list[bytes], sorted(unique))
        latest = dict(zip(wanted, self.index.read(wanted), strict=True))
        replaced: list[int | None] = []
        append = replaced.append
        block_end = (clock._block + 1) * SAMPLE_EVERY  # the next offset that starts a block, if above
        for offset, stamp, key, tombstone, deliver_at in zip(
            offsets, stamps, keys, tombstones, deliver_ats, strict=True
        ):
            if offset >= block_end or offset < block_end - SAMPLE_EVERY:
                clock._block = offset // SAMPLE_EVERY
                block_end = (clock._block + 1) * SAMPLE_EVERY
                clock._offsets.append(offset)
                clock._before.append(now)
            if now is None or stamp > now:
                now = stamp
            if not key:
                append(None)
                continue
            previous = latest[key]
            # An entry outside [start, offset) was left by an earlier reading (see `start`).
            if previous is not None and previous[1] is not None and start <= previous[0] < offset and now < previous[1]:
                append(previous[0])
            else:
                append(None)
            latest[key] = (offset, None if tombstone else deliver_at)
        clock.now = now
        if latest:
            self.index.write(cast(dict[bytes, Entry], latest))  # every key read was written in the loop
        return replaced

    def newest(self, key: bytes) -> Pending | None:
        """The key's newest record this step has read; None when it read none (an entry outside
        [start, the next record) was left by an earlier reading of the log)."""
        (entry,) = self.index.read([key])
        start = self.start
        if entry is None or start is None or entry[0] < start:
            return None
        return Pending(*entry)

    def due_through(self, now_ms: int) -> int:
        """Entries due at this time or earlier may go (the clock gate): the log's clock, never past
        now; -1 before any record."""
        now = self.clock.now
        return min(now_ms, now) if now is not None else -1
