"""The tracker contract, modelled on Pulsar's DelayedDeliveryTracker.

A tracker indexes positions, never payloads: the inbound partition is the ledger, and a due
position is read back from it. One tracker serves one inbound partition and is shared by every
subscription of its topic, so the index costs the same whatever the number of subscriptions.

Ordering: entries come out by deliver-at, and entries with equal deliver-at in offset order,
which is the order the producer wrote them (FIFO). Strictness: an entry never comes out before
its deliver-at, by the injected clock.

The delivered watermark: every entry leaves the tracker in key order (deliver-at, offset), and so
does every due position the caller delivers at once instead of indexing it (see `add`). So one key,
`delivered_through()`, says exactly which positions are done: those at or below it. The commit
carries it, and a rebuild of a lost index skips what it covers: nothing is delivered twice.
"""

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from sidecar.clock import Clock
from sidecar.policy.by_key import KeyIndex
from sidecar.tracker.keys import MemoryKeys

if TYPE_CHECKING:
    from sidecar.tracker.storage.base import BucketWrite


class Due(NamedTuple):
    deliver_at: int
    offset: int


due_of: Callable[[tuple[int, int]], Due] = functools.partial(tuple.__new__, Due)
"""Due from a (deliver_at, offset) pair without the NamedTuple's Python-level __new__: `map(due_of,
zip(ats, offsets))` builds a burst's entries in C, at about half the cost of `map(Due, ats, offsets)`."""


KEY_SHIFT = 64
NOTHING_DELIVERED = -1


def pack(deliver_at: int, offset: int) -> int:
    """The entry's place in delivery order, as one integer: deliver-at, then offset."""
    return deliver_at << KEY_SHIFT | offset


class Snapshots(Protocol):
    """An index kept as sealed buckets with ids (PIP-195): what the state topic mirrors, so that
    another member takes a partition over without reading its log again."""

    def sealed_layout(self) -> tuple[tuple[int, ...], int, int | None]:
        """(live bucket ids, next bucket id, lowest offset not sealed yet)."""
        ...

    def restore(self, buckets: "list[BucketWrite]", next_bucket_id: int, delivered_through: int) -> None:
        """Replace the index by these sealed buckets; new buckets take ids from `next_bucket_id`."""
        ...

    def clear(self) -> None: ...


class DelayedDeliveryTracker(ABC):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._keys: KeyIndex | None = None

    @abstractmethod
    def add(self, offset: int, deliver_at: int, *, deliver_now: bool = True) -> bool:
        """Index a delayed position. False when the caller must deliver it now.

        With `deliver_now` False a due position is indexed like any other (an exactly-once rebuild,
        which delivers nothing until it has read every pending record); positions at or below the
        watermark still return False.

        That is when it is due and nothing indexed comes before it, or when it lies at or below the
        delivered watermark (a rebuild finding a record that is due by an earlier pop); the
        watermark then moves up to it. A due position that indexed entries precede is indexed
        and comes out with them, in order. Adding a position that is already indexed changes
        nothing (a replayed record is not delivered twice) and returns True.
        """

    def add_many(self, offsets: list[int], deliver_ats: list[int], *, deliver_now: bool = True) -> list[int]:
        """`add` of each (offsets[i], deliver_ats[i]), offsets strictly rising: the indexes of the
        positions the caller must deliver now. A tracker may index a whole slice of intake at once."""
        pairs = enumerate(zip(offsets, deliver_ats, strict=True))
        return [i for i, (offset, at) in pairs if not self.add(offset, at, deliver_now=deliver_now)]

    @abstractmethod
    def next_delivery_time(self) -> int | None:
        """The earliest deliver-at still indexed, or None when the tracker is empty."""

    @abstractmethod
    def pop_due(self, max_messages: int, until_ms: int | None = None) -> list[Due]:
        """Remove and return up to max_messages entries due by until_ms (default: now), earliest first.

        A later until_ms drains entries before their time: only for dead-lettering them.

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
    def delivered_through(self) -> int:
        """The packed key (`pack`) of the last position delivered, or NOTHING_DELIVERED."""

    @abstractmethod
    def restore_delivered_through(self, key: int) -> None:
        """Before a rebuild into an empty tracker: the watermark the last commit recorded."""

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

    def checkpoint(self, index_cursor: int, lineage: tuple[str, ...] = (), rules: str = "") -> None:  # noqa: B027
        """Make adds and pops durable, and record that the index is complete below index_cursor,
        which group commits it agrees with (`lineage`) and the intake rules it was judged by
        (`rules`): see PartitionMeta.

        Called after the producer is flushed and before inbound offsets are committed; in-memory
        trackers have nothing to do.
        """

    def lineage(self) -> tuple[str, ...]:
        """The group commits the durable index agrees with, newest first (empty: none known)."""
        return ()

    def checkpointed_rules(self) -> str:
        """The intake rules the durable index was judged by ("" : not known)."""
        return ""

    def due_counts(self, limits: list[int]) -> list[int]:
        """For each limit (epoch ms), about how many pending entries fall due at or before it: the
        pending-by-due-time gauge. A durable index may estimate within a snapshot segment."""
        return [0 for _ in limits]

    def ranges_due(self, after_ms: int, until_ms: int) -> list[tuple[int, int]]:
        """Offset ranges [first, last] holding every pending entry due in (after_ms, until_ms], for
        reading their payloads in bulk (dispatch/roll.py). Empty: this tracker does not say."""
        return []

    def key_index(self) -> KeyIndex:
        """The key index of a keyed topic's partition (policy/by_key.py), emptied by `clear`. Here
        a dict; a durable tracker keeps it with its index, off the heap."""
        if self._keys is None:
            self._keys = MemoryKeys()
        return self._keys

    def snapshots(self) -> Snapshots | None:
        """The index as sealed buckets for the state topic; None for an index that keeps none."""
        return None

    def clear(self) -> None:
        """Forget every entry (the subscription or topic was deleted)."""
        self._keys = None

    def close(self) -> None:  # noqa: B027
        """Release memory and storage handles; the durable state stays for the next owner."""
