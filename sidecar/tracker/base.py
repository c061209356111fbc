"""The tracker contract, modelled on Pulsar's DelayedDeliveryTracker.

A tracker indexes positions, never payloads: the inbound partition is the ledger, and a due
position is read back from it. One tracker serves one inbound partition and is shared by every
subscription of its topic, so the index costs the same whatever the number of subscriptions.

Ordering: entries come out by deliver-at, and entries with equal deliver-at in offset order,
which is the order the producer wrote them (FIFO). Strictness: an entry never comes out before
its deliver-at, by the injected clock.
"""

from abc import ABC, abstractmethod
from typing import NamedTuple

from sidecar.clock import Clock


class Due(NamedTuple):
    deliver_at: int
    offset: int


class DelayedDeliveryTracker(ABC):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    @abstractmethod
    def add(self, offset: int, deliver_at: int) -> bool:
        """Index a delayed position. False when it is already due: the caller delivers it now.

        Adding a position that is already indexed changes nothing (a replayed record is not
        delivered twice) and returns True.
        """

    @abstractmethod
    def next_delivery_time(self) -> int | None:
        """The earliest deliver-at still indexed, or None when the tracker is empty."""

    @abstractmethod
    def pop_due(self, max_messages: int) -> list[Due]:
        """Remove and return up to max_messages due entries, earliest first.

        Removal becomes permanent at the next checkpoint(), which the caller runs only after
        every popped entry has been delivered and acknowledged by the broker.
        """

    @abstractmethod
    def peek(self, after: Due | None, until_ms: int, max_messages: int) -> list[Due]:
        """Entries due by until_ms and after `after` (in deliver-at, offset order), without removing them.

        For reading payloads ahead of their time: the caller remembers the last entry it saw and
        asks again from there. Entries that are not in memory yet (an unloaded snapshot segment)
        may be left out; the caller reads those when they are popped.
        """

    @abstractmethod
    def contains(self, offset: int) -> bool: ...

    @abstractmethod
    def __len__(self) -> int:
        """Number of delayed messages still to deliver."""

    @abstractmethod
    def earliest_pending_offset(self) -> int | None:
        """The lowest inbound offset the tracker still has to deliver, or None.

        A tracker that is not durable needs the log from here on to rebuild after a crash, so the
        inbound offset committed for its partition never passes this.
        """

    @property
    @abstractmethod
    def durable(self) -> bool:
        """True when checkpoint() makes the index survive a crash without replaying the log."""

    def has_message_available(self) -> bool:
        next_time = self.next_delivery_time()
        return next_time is not None and next_time <= self.clock.now_ms()

    def index_cursor(self) -> int | None:
        """The inbound offset up to which a durable index is complete, or None if unknown."""
        return None

    def checkpoint(self, index_cursor: int) -> None:  # noqa: B027 - optional for in-memory trackers
        """Make adds and pops durable, and record that the index is complete below index_cursor.

        Called after the producer is flushed and before inbound offsets are committed.
        """

    def clear(self) -> None:  # noqa: B027
        """Forget every entry (the subscription or topic was deleted)."""

    def close(self) -> None:  # noqa: B027
        """Release memory and storage handles; the durable state stays for the next owner."""
