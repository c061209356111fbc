"""What a partition of a keyed topic (`by_key: replace`) keeps beside its index.

- the key step (policy/by_key.py): the key index and the clock of the rule;
- the offsets replaced while still in the index: they come out at their time and go to nobody
  (the index is shared and is not edited in place, as with cancels);
- when the sidecar last wrote a clock record to the partition, so that an idle partition's due
  entries are let through by a timestamp the log holds (the gate of by_key.py).

None of it outlives the member: a partition that holds keyed records is read again from its
earliest pending record when its next owner starts (PartitionState.start), with the log's clock
as the commit recorded it there, which puts all of it back, decided the same way.
"""

from collections import OrderedDict
from collections.abc import Sequence

from pyroaring import BitMap64

from sidecar.control.overrides import REMEMBERED
from sidecar.policy.by_key import KeyIndex, KeyStep

CLOCK_RETRY_MS = 1_000
"""A clock record not read back within this long is written again (lost with an aborted
transaction, or stamped by a broker whose LogAppendTime lags the due time)."""

CLOCK_LEAD_MS = 100
"""A clock record is stamped this far ahead of the sidecar's clock, and written once an entry is
due within half of it: it is back from the log before the entries it opens the gate for are due,
so they go on time (the gate is never past the sidecar's clock, so never early). Stamped at the
time instead, every delivery of an idle partition waited for a write and a read of the log after
its time: 27 ms at p50, 55 at p99 (docs/benchmarks.md). The price: a record read after it replaces
nothing due by its stamp, so a replacement must be in the log up to this long before the due time."""


class KeyedPartition:
    def __init__(self, index: KeyIndex, clock_before: int | None = None) -> None:
        self.step = KeyStep(index, clock_before)
        self.replaced = BitMap64()
        self._gone: OrderedDict[int, None] = OrderedDict()
        """Replaced offsets that came out of the index to nobody, the latest REMEMBERED."""
        self.clock_sent_ms: int | None = None
        """When the last clock record was written (stamped CLOCK_LEAD_MS later), until a record
        stamped at least as late is read."""

    def newest(self, key: bytes) -> tuple[int, bool] | None:
        """(offset, delayed) of the key's newest record this state has read; None when it read none."""
        entry = self.step.newest(key)
        return None if entry is None else (entry.offset, entry.deliver_at is not None)

    def moved(self, key: bytes, origin: int, deliver_at: int) -> None:
        """A reschedule's fact was read: the key's pending record, if it is still `origin`, is
        due at the new time, which the rule compares with from now on."""
        entry = self.step.newest(key)
        if entry is not None and entry.offset == origin:
            self.step.index.write({key: (origin, deliver_at)})

    def take_many(
        self,
        offsets: Sequence[int],
        stamps: Sequence[int],
        keys: Sequence[bytes | None],
        tombstones: Sequence[bool],
        deliver_ats: Sequence[int | None],
    ) -> list[int | None]:
        """`take` of a slice of records at once (by_key.KeyStep.take_many): the offset each replaces."""
        replaced = self.step.take_many(offsets, stamps, keys, tombstones, deliver_ats)
        if replaced.count(None) != len(replaced):
            self.replaced.update(o for o in replaced if o is not None)
        if stamps:
            self._read(max(stamps))
        return replaced

    def note(self, offset: int, timestamp: int) -> None:
        """A record that is not a keyed message (the sidecar's own, or judged by another rule): it
        moves the clock all the same."""
        self.step.note(offset, timestamp)
        self._read(timestamp)

    def _read(self, timestamp: int) -> None:
        if self.clock_sent_ms is not None and timestamp >= self.clock_sent_ms + CLOCK_LEAD_MS:
            self.clock_sent_ms = None

    def gate(self, now_ms: int) -> int:
        """Entries due at this time or earlier may go (by_key.KeyStep.due_through)."""
        return self.step.due_through(now_ms)

    def popped(self, offset: int) -> bool:
        """An entry came out of the index: True when it was replaced (it goes to nobody)."""
        if offset in self.replaced:
            self.replaced.discard(offset)
            self._gone[offset] = None
            if len(self._gone) > REMEMBERED:
                self._gone.popitem(last=False)
            return True
        return False

    def was_replaced(self, offset: int) -> bool:
        """Replaced: still in the index, or among the last REMEMBERED that came out (for the lookup)."""
        return offset in self.replaced or offset in self._gone

    def clock_due_at(self, next_due: int | None) -> int | None:
        """When to write the next clock record, while entries are pending: once the next one is due
        within half the lead, and the log's clock is less than half the lead ahead. Once one is on
        its way, not before it is overdue. (Asking only whether the next entry is past the log's
        clock would wait until the entries below the clock are gone, at their time, and those due
        just after it would wait for the round trip.)"""
        if next_due is None:
            return None
        clock = self.step.clock.now
        at = (next_due if clock is None else max(next_due, clock + 1)) - CLOCK_LEAD_MS // 2
        return at if self.clock_sent_ms is None else max(at, self.clock_sent_ms + CLOCK_RETRY_MS)

    def clock_wanted(self, next_due: int | None, now_ms: int) -> int | None:
        """The timestamp of a clock record to write now, or None."""
        at = self.clock_due_at(next_due)
        return now_ms + CLOCK_LEAD_MS if at is not None and at <= now_ms else None

    def forget_below(self, offset: int) -> None:
        """Nothing below `offset` is pending any more: the clock need not answer from there, and a
        replaced offset there will not come out of the index (a rebuild sets aside again the ones
        below the committed watermark, which it does not index)."""
        self.step.clock.forget_below(offset)
        if self.replaced and self.replaced.min() < offset:
            self.replaced.remove_range(0, offset)
