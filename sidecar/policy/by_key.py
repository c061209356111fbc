"""Keyed replacement (`delayed_delivery: {by_key: replace}`): the newest record for a key decides.

The rule must be one that a rebuild from the log decides the same way as the live intake did,
whichever member reads it and from where. So it looks only at the log:

    A record R at offset o for key K replaces K's previous record P (offset p, deliver-at T) when,
    and only when, P was delayed and no record of the partition from p to o (any key, P and R
    included) has a timestamp at or past T.

A timestamp at or past T in between means P's time had come before R was in the log, so P is
delivered and R is a record of its own. The timestamps are those of the log (CreateTime or
LogAppendTime), and the maximum over the range, not R's own timestamp, is what counts: a producer
whose clock lags cannot put a record "before" one already past T.

The delivery side keeps the rule true: a keyed partition's entry due at T is delivered only once
a record with a timestamp at or past T has been read after it (the clock gate), so that any record
read later finds that timestamp in its range and replaces nothing. A partition with no such record
gets one written by the sidecar.

No I/O here: the key index is given (RocksDB beside the bucket index in the engine, a dict in the
tests), and so is the order of the records, which is the log's.
"""

from bisect import bisect_left
from collections.abc import Sequence
from typing import NamedTuple, Protocol


class Pending(NamedTuple):
    """A key's newest record, as the key index keeps it."""

    offset: int
    deliver_at: int | None
    """None: not delayed (delivered at once, or a tombstone); nothing of it can be replaced."""


class KeyIndex(Protocol):
    def get(self, key: bytes) -> Pending | None: ...

    def put(self, key: bytes, pending: Pending) -> None: ...

    def prefetch(self, keys: Sequence[bytes | None]) -> None:
        """The keys of a slice about to be taken: an index on disk may read them at once."""


class Verdict(NamedTuple):
    replaced: int | None
    """The offset of the key's record that this one replaces, if any."""
    deliver: bool
    """False for a tombstone: it cancels, and is not delivered itself."""


NOT_KEYED = Verdict(None, True)


class WindowClock:
    """The greatest timestamp over the records read from any offset on: the `no record from p to o`
    of the rule, for every p at once.

    It keeps the records whose timestamp no later record reaches (a strictly decreasing run), so
    with timestamps in order it holds one record, and the answer is a binary search.
    """

    def __init__(self) -> None:
        self._offsets: list[int] = []
        self._stamps: list[int] = []

    def note(self, offset: int, timestamp: int) -> None:
        """A record read, in offset order."""
        offsets, stamps = self._offsets, self._stamps
        while stamps and stamps[-1] <= timestamp:
            stamps.pop()
            offsets.pop()
        offsets.append(offset)
        stamps.append(timestamp)

    def since(self, offset: int) -> int | None:
        """The greatest timestamp of the records read at `offset` or later; None if none was."""
        i = bisect_left(self._offsets, offset)
        return self._stamps[i] if i < len(self._stamps) else None

    @property
    def latest(self) -> int | None:
        """The newest record's timestamp (it is always the last one kept)."""
        return self._stamps[-1] if self._stamps else None

    def forget_below(self, offset: int) -> None:
        """No pending record is below `offset` any more: nobody will ask from there."""
        i = bisect_left(self._offsets, offset)
        if i:
            del self._offsets[:i], self._stamps[:i]

    def __len__(self) -> int:
        return len(self._offsets)


def replaces(previous: Pending | None, clock: WindowClock) -> int | None:
    """The rule, once the new record has been noted on the clock: the offset it replaces, if any."""
    if previous is None or previous.deliver_at is None:
        return None
    newest = clock.since(previous.offset)
    return previous.offset if newest is None or newest < previous.deliver_at else None


class KeyStep:
    """The rule applied to one partition's records in offset order, live and in a rebuild alike.

    A rebuild starts at the partition's earliest pending offset with an empty clock: every record
    that could still be replaced is at or past it, and so is every record of the ranges the rule
    looks at. A key whose newest record is below it was decided already (delivered, or replaced by
    a record also below it), so the index may forget it; what it remembers of it is never pending
    by the rule, since the clock gate let it go only once a later timestamp reached its time.
    """

    def __init__(self, index: KeyIndex) -> None:
        self.index = index
        self.clock = WindowClock()
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
        self.note(offset, timestamp)
        if not key:
            return NOT_KEYED
        previous = self.index.get(key)
        start = offset if self.start is None else self.start  # set by note(): never None here
        if previous is not None and not start <= previous.offset < offset:
            previous = None
        replaced = replaces(previous, self.clock)
        self.index.put(key, Pending(offset, None if tombstone else deliver_at))
        return Verdict(replaced, not tombstone)

    def take_many(
        self,
        offsets: Sequence[int],
        stamps: Sequence[int],
        keys: Sequence[bytes | None],
        tombstones: Sequence[bool],
        deliver_ats: Sequence[int | None],
    ) -> list[int | None]:
        """`take` of each record in turn, for a slice of intake: the offset each one replaces. The
        same steps with the calls inlined: per record, a call costs as much as the rule."""
        if not offsets:
            return []
        if self.start is None:
            self.start = offsets[0]
        start = self.start
        clock_offsets, clock_stamps = self.clock._offsets, self.clock._stamps
        self.index.prefetch(keys)
        get, put = self.index.get, self.index.put
        replaced: list[int | None] = []
        for offset, stamp, key, tombstone, deliver_at in zip(
            offsets, stamps, keys, tombstones, deliver_ats, strict=True
        ):
            while clock_stamps and clock_stamps[-1] <= stamp:  # WindowClock.note
                clock_stamps.pop()
                clock_offsets.pop()
            clock_offsets.append(offset)
            clock_stamps.append(stamp)
            if not key:
                replaced.append(None)
                continue
            previous = get(key)
            found = None
            if previous is not None and previous.deliver_at is not None and start <= previous.offset < offset:
                i = bisect_left(clock_offsets, previous.offset)  # WindowClock.since, never empty here
                if clock_stamps[i] < previous.deliver_at:
                    found = previous.offset
            replaced.append(found)
            put(key, Pending(offset, None if tombstone else deliver_at))
        return replaced

    def due_through(self, now_ms: int) -> int:
        """Entries due at this time or earlier may go (the clock gate): the newest record's
        timestamp, never past now; -1 before any record. It is on the safe side: a greater
        timestamp earlier in the partition may already have decided an entry, but only a timestamp
        read after every pending entry decides them all."""
        latest = self.clock.latest
        return min(now_ms, latest) if latest is not None else -1
