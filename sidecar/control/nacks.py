"""Which pending nack is the one in force: for one subscription and message, the latest command wins.

A nack is indexed by the offset of its accepted record in the control topic, so the control log is
the nack's write-ahead log: a control offset is never committed past the earliest nack still
pending, and without other state a restart reads the control partition again from there, which
rebuilds this table too.

With a state topic, this table also keeps a changelog per control partition, as a Kafka Streams
store does: the accepted nacks still pending, keyed by their accepted record's offset, so a new
owner loads them from the state topic instead of reading the control log again (state/journal.py
writes them there, in chunks).
An entry is written when its accepted record is read and marked dead when it stops mattering:

- at once when a later command supersedes it (the later one's entry is written first, in the same
  write), so a restore never revives a superseded nack;
- once redelivered (or dropped at due time), only after a commit whose delivered watermark covers
  it: a restore takes the committed watermark, and must still find every nack it does not cover.

One that stops mattering before any write took it is never written at all, and needs no mark.

An entry is named by its index offset *and* its subscription: a cancel or a reschedule indexes one
acceptance per subscription at its own offset, and each lives or dies on its own.
"""

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from sidecar.control.commands import AcceptedNack, NackCommand
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker.base import pack

Entry = tuple[int, str]
"""A changelog entry's name: (index offset, subscription)."""


@dataclass
class _Changes:
    """What the state topic has not been told yet about one control partition's nacks."""

    upserts: dict[Entry, AcceptedNack] = field(default_factory=dict)
    """Entry -> the nack, pending."""
    dead: set[Entry] = field(default_factory=set)
    """Entries that must go (superseded, or settled and covered)."""
    settled: list[tuple[int, Entry]] = field(default_factory=list)
    """A heap of (packed deliver-at and offset, entry): settled nacks the state topic holds, waiting
    for a commit to cover them. A heap, because a burst leaves tens of thousands waiting, and each
    checkpoint takes only those a commit covers now."""


class LatestNacks:
    def __init__(self, changelog: bool = False) -> None:
        """`changelog`: keep the changes for the state topic (taken at each checkpoint by `take`)."""
        self._latest: dict[tuple[str, str, int, int], tuple[str, int, int, int, int, int, bool]] = {}
        """Message -> (control topic, partition, command offset, index offset, deliver-at,
        redelivery count of the command, cancelled) of the nack in force."""
        self._at: dict[tuple[str, int, int], list[tuple[str, str, int, int]]] = {}
        """(control topic, partition, index offset) -> the messages whose nack in force is indexed
        there: what a due index entry stands for, without reading the control log back."""
        self._changes: dict[TopicPartitionKey, _Changes] | None = {} if changelog else None

    def accept(self, nack: AcceptedNack, offset: int) -> bool:
        """An acceptance indexed at `offset`: in force for its message unless a later command is.
        True when it superseded a pending nack (not a cancelled one).

        Commands for one message share its key, hence one control partition, so their offsets
        give their order (when a topic moves to another control topic, the one read last wins).
        An acceptance written twice (a crash before the commit) or read again changes nothing.
        """
        return self._take(nack, offset, journal=True)

    def restore(self, nack: AcceptedNack, offset: int) -> None:
        """A pending nack loaded from the state topic, which holds it already."""
        self._take(nack, offset, journal=False)

    def claim(self, nack: AcceptedNack, offset: int) -> bool:
        """True when this due nack is still the latest for its message; it is then settled."""
        changes = self._of(nack.source[:2])
        if changes is not None:
            entry = (offset, nack.command.subscription)
            # One the state topic was never told of needs no dead mark either (a burst's nacks mostly):
            # the commit after the next checkpoint covers it, and a crash before reads or judges it again.
            if changes.upserts.pop(entry, None) is None:
                heapq.heappush(changes.settled, (pack(nack.deliver_at, offset), entry))
        message = nack.command.message_key
        current = self._latest.get(message)
        if current is None or current[:3] != nack.source:
            return False
        del self._latest[message]
        self._unindex(current, message)
        return True

    def holds(self, nack: AcceptedNack) -> bool:
        """This very acceptance is the one in force for its message."""
        current = self._latest.get(nack.command.message_key)
        return current is not None and current[:3] == nack.source

    def settle_due(self, topic: str, partition: int, offset: int) -> list[AcceptedNack]:
        """The acceptances in force that the index entry at `offset` of a control partition stands
        for (none when later commands superseded them all), each settled as `claim` settles it.

        Every acceptance indexed there is in force (a superseded one leaves the entry when it is
        superseded), so none needs the check `claim` makes. Cancelled ones are among them, for
        the caller to count. Tuples are made with tuple.__new__: a NamedTuple's constructor is a
        Python function, and a burst of nacks settles tens of thousands a second."""
        messages = self._at.pop((topic, partition, offset), None)
        if not messages:
            return []
        changes = self._of((topic, partition))
        latest, new = self._latest, tuple.__new__
        found = []
        for message in messages:
            entry = latest.pop(message)
            sub, nacked_topic, nacked_partition, nacked_offset = message
            deliver_at = entry[4]
            command = new(NackCommand, (sub, nacked_topic, nacked_partition, nacked_offset, None, deliver_at, entry[5]))
            found.append(new(AcceptedNack, (command, deliver_at, entry[:3], entry[6])))
            if changes is not None and changes.upserts.pop((offset, sub), None) is None:
                heapq.heappush(changes.settled, (pack(deliver_at, offset), (offset, sub)))
        return found

    def take(self, partition: TopicPartitionKey, covered: int) -> tuple[list[tuple[Entry, bytes]], list[Entry]]:
        """(entries to write with their accepted record, entries to mark dead) for a control partition.

        `covered`: the delivered watermark that the commit going with these records (exactly
        once), or the last commit before them (at least once), makes durable.
        """
        changes = self._existing(partition)
        if changes is None:
            return [], []
        settled = changes.settled
        while settled and settled[0][0] <= covered:
            changes.dead.add(heapq.heappop(settled)[1])
        upserts = sorted((entry, nack.encode()) for entry, nack in changes.upserts.items())
        dead = sorted(changes.dead)
        changes.upserts, changes.dead = {}, set()
        return upserts, dead

    def unwritten(self, partition: TopicPartitionKey) -> int:
        """Entries a control partition accepted that the state topic has not been told of yet."""
        changes = self._existing(partition)
        return 0 if changes is None else len(changes.upserts)

    def forget_partition(self, partition: TopicPartitionKey) -> None:
        """A control partition went to another sidecar: its commands are not ours to settle."""
        self._latest = {k: v for k, v in self._latest.items() if v[:2] != partition}
        self._at = {k: v for k, v in self._at.items() if k[:2] != partition}
        if self._changes is not None:
            self._changes.pop(partition, None)

    def pending_for(
        self, topic: str, partition: int, offset: int, subscriptions: Iterable[str]
    ) -> dict[str, tuple[int, int]]:
        """The nacks of a message in force here, by subscription: (deliver-at, redelivery count it will carry)."""
        found = {}
        for sub in subscriptions:
            entry = self._latest.get((sub, topic, partition, offset))
            if entry is not None and not entry[6]:  # (a cancel's entry stands until it is settled)
                found[sub] = (entry[4], entry[5] + 1)
        return found

    def __len__(self) -> int:
        return len(self._latest)

    def _take(self, nack: AcceptedNack, offset: int, journal: bool) -> bool:
        topic, partition, command_offset = nack.source
        where = (topic, partition)
        message = nack.command.message_key
        sub = message[0]
        current = self._latest.get(message)
        if current is not None and current[:3] == nack.source:
            if current[3] != offset and journal:
                self._dead(where, (offset, sub))  # the same acceptance written twice: this copy never counts
            return False
        if current is None or current[:2] != where or current[2] < command_offset:
            self._at.setdefault((topic, partition, offset), []).append(message)
            self._latest[message] = (
                topic,
                partition,
                command_offset,
                offset,
                nack.deliver_at,
                nack.command.redelivery_count,
                nack.cancelled,
            )
            changes = self._of(where) if journal else None
            if changes is not None:
                changes.upserts[(offset, sub)] = nack
            if current is None:
                return False
            self._unindex(current, message)
            self._dead(current[:2], (current[3], sub))
            return not current[6]
        if journal:
            self._dead(where, (offset, sub))  # an earlier command, read after a later one: superseded already
        return False

    def _unindex(self, entry: tuple[str, int, int, int, int, int, bool], message: tuple[str, str, int, int]) -> None:
        where = (entry[0], entry[1], entry[3])
        messages = self._at[where]
        messages.remove(message)
        if not messages:
            del self._at[where]

    def _dead(self, partition: TopicPartitionKey, entry: Entry) -> None:
        changes = self._of(partition)
        if changes is not None and changes.upserts.pop(entry, None) is None:  # (never written: nothing to undo)
            changes.dead.add(entry)

    def _existing(self, partition: TopicPartitionKey) -> _Changes | None:
        """The partition's changes so far, without starting any (reading them must not)."""
        return self._changes.get(partition) if self._changes is not None else None

    def _of(self, partition: TopicPartitionKey) -> _Changes | None:
        if self._changes is None:
            return None
        found = self._changes.get(partition)  # not setdefault: it would build a _Changes per nack
        if found is None:
            found = self._changes[partition] = _Changes()
        return found
