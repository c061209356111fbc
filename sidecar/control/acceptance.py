"""Nack commands in, decided once: rejected to the control dead-letter topic, or accepted durably.

An accepted command becomes a line of an *accepted record* on the command's own control partition
(see `AcceptedNack`): one record per control partition for each slice of commands judged, written
before the slice's due nacks go out and before any checkpoint. It is indexed at once by the
command's own offset: waiting for the accepted record to come back would put every nack of a
burst behind all the commands before it. The accepted record is the durable word. The member that
wrote it skips it when it comes back; a restart, with or without local state, loads the pending
nacks from the state topic and reads the accepted records after them again (without a state topic:
from the earliest one still pending, in the commit metadata), skipping those the delivered
watermark covers. So the control offset can be committed past every command as soon as it is
judged, and commands below the committed offset are never judged a second time.
"""

import logging
from collections import Counter
from collections.abc import Callable

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.control.cancels import REJECTED, WRONG_CONTROL_TOPIC, MessageCommand, loose_command, message_kind
from sidecar.control.commands import (
    ACCEPTED_BY,
    UNKNOWN_MESSAGE,
    UNKNOWN_SUBSCRIPTION,
    AcceptedNack,
    NackCommand,
    accepted_key,
    cancelled_acceptances,
    check_max_delay,
    moved_acceptances,
    parse_accepted_record,
    parse_command,
)
from sidecar.control.forwarding import Forwarding
from sidecar.control.nacks import LatestNacks
from sidecar.control.topics import ControlTopics, side_topics
from sidecar.dispatch.reader import LogReader, NoSuchPartition
from sidecar.errors import Refused, RejectedRecord
from sidecar.metrics import Metrics
from sidecar.outbound.writer import Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState
from sidecar.policy.routes import Routes
from sidecar.tracker.base import pack

logger = logging.getLogger(__name__)

MAX_ACCEPTED_BYTES = 256 * 1024
"""An accepted record holds lines up to this size (a slice's commands seldom come near it)."""

UNKNOWN_LABEL = "(unknown)"
"""The subscription label of commands for a topic or subscription that is not configured."""


class Acceptance:
    def __init__(
        self,
        controls: ControlTopics,
        group_id: str,
        writer: Writer,
        reader: LogReader,
        partitions: dict[TopicPartitionKey, PartitionState],
        routes: Callable[[], dict[str, Routes]],
        nacks: LatestNacks,
        metrics: Metrics,
        clock: Clock,
        forwarding: Forwarding,
    ) -> None:
        """`forwarding` takes the cancel and reschedule commands (forwarding.py)."""
        self._forwarding = forwarding
        self._controls = controls
        self._group = group_id.encode()
        self._writer = writer
        self._reader = reader
        self._partitions = partitions
        self._routes = routes
        self._nacks = nacks
        self._metrics = metrics
        self._clock = clock
        self._high_watermarks: dict[TopicPartitionKey, int] = {}
        self._accepted: Counter[str] = Counter()
        """Nacks accepted per subscription, not counted in the metrics yet (see `count`)."""
        self._later: list[AcceptedNack] = []
        """Nacks judged and indexed for later since the last `indexed` (their redelivery can be built)."""
        self._unwritten: dict[TopicPartitionKey, tuple[PartitionState, list[tuple[bytes | None, int, bytes]]]] = {}
        """Control partition -> its state and the acceptances judged but not written yet: (command
        key, command offset, the line)."""
        metrics.child(metrics.replayed, controls.default)  # exported at 0 from the start

    def take(self, record: Message, state: PartitionState, due_now: list[tuple[int, AcceptedNack]]) -> None:
        """One control record: a command to judge, or an accepted record to index."""
        offset = record.offset()
        state.next_offset = offset + 1
        if offset < state.replay_until:  # read again after a restart or a handoff
            self._metrics.child(self._metrics.replayed, state.topic).inc()
        headers = record.headers()  # commands seldom carry any: no dict built for them
        if headers and dict(headers).get(ACCEPTED_BY) == self._group:
            key = accepted_key(record.value())
            if key is not None and key in state.unread_facts:
                state.unread_facts.discard(key)  # ours, indexed when it was accepted: not even decoded
                return
            lines = parse_accepted_record(record.value(), state.topic)
            if lines is not None:
                for accepted in lines:
                    self._index(accepted, accepted.source[2], offset < state.replay_until, state, due_now)
                return
        if offset < state.replay_until:
            return  # judged before the restart: accepted records or the dead-letter topic hold the outcome
        self._judge(record, state, due_now)

    def _index(
        self,
        accepted: AcceptedNack,
        key: int,
        replayed: bool,
        state: PartitionState,
        due_now: list[tuple[int, AcceptedNack]],
    ) -> None:
        """An accepted record an earlier member or run wrote: indexed by its command's offset (`key`),
        unless its key is at or below the delivered watermark, which means it went out (or was
        superseded) before. Entries leave the index in key order, so that is exact.

        One in force already needs nothing: restored from the state topic, or its command judged
        again in this run (after a crash before the commit), which may be redelivering it now."""
        if self._nacks.holds(accepted):
            return
        self._nacks.accept(accepted, key)
        if pack(accepted.deliver_at, key) <= state.tracker.delivered_through():
            self._nacks.claim(accepted, key)  # redelivered, or superseded, before
            return
        # Nothing is redelivered while replaying, in either mode: an accepted record read again may be
        # superseded or cancelled by one further on (see partitions/metadata.py for exactly once).
        if not state.tracker.add(key, accepted.deliver_at, deliver_now=not replayed):
            due_now.append((key, accepted))

    def _judge(self, record: Message, state: PartitionState, due_now: list[tuple[int, AcceptedNack]]) -> None:
        subscription = ""
        try:
            parsed = parse_command(record.value())
        except RejectedRecord as rejected:
            if message_kind(record.value()) is not None:  # a malformed cancel or reschedule: answered
                loose = loose_command(record.value())
                self._forwarding.refuse(record, loose, REJECTED, rejected.code, rejected.message)
            else:
                self.reject(record, rejected)
                self._metrics.nacks.labels("", rejected.code.lower()).inc()
            return
        if isinstance(parsed, MessageCommand):
            self._forwarding.take(record, parsed, lambda r, c, at: self._take_nacks(r, c, at, state, due_now))
            return
        command = parsed
        try:
            try:
                self._controls.check(record.topic(), command.topic)
            except Refused as wrong:
                raise RejectedRecord(WRONG_CONTROL_TOPIC, wrong.message) from None
            subscription = command.subscription
            routes = self._routes().get(command.topic)
            if routes is None or routes.route.subscription(subscription) is None:
                raise RejectedRecord(
                    UNKNOWN_SUBSCRIPTION,
                    f"topic {command.topic!r} has no subscription {subscription!r} in the policies in force",
                )
            stamp = record.timestamp()[1]
            sent_ms = stamp if stamp > 0 else self._clock.now_ms()
            check_max_delay(command, routes.route.delay, sent_ms)
            self._check_known_message(command, routes)
        except RejectedRecord as rejected:
            self.reject(record, rejected)
            # Commands are untrusted input: only configured subscriptions become label values.
            label = subscription if rejected.code != UNKNOWN_SUBSCRIPTION else UNKNOWN_LABEL
            self._metrics.nacks.labels(label, rejected.code.lower()).inc()
            return
        # From the command's own timestamp, so the time does not depend on when it was read.
        source = (record.topic(), record.partition(), record.offset())
        accepted = AcceptedNack(command, command.effective_deliver_at(sent_ms), source)
        # Indexed now, by the command's own offset, not when the accepted record comes back behind
        # every command written before it: a burst of nacks falls due on time.
        key = record.offset()
        self._accept(accepted, key)
        if state.tracker.add(key, accepted.deliver_at):
            # The accepted record is the durable word for a restart; read back by this member, it is skipped.
            self._write_accepted(record, accepted, state)
            self._later.append(accepted)
        else:
            # Due already (a backlog): redelivered in this slice, before any checkpoint commits the
            # command's offset, so it needs no accepted record. A crash before that commit judges
            # the command again (its offset is not below the committed one).
            due_now.append((key, accepted))
        self._accepted[subscription] += 1

    def indexed(self) -> list[AcceptedNack]:
        """The nacks judged and indexed for later since the last call."""
        later, self._later = self._later, []
        return later

    def count(self) -> None:
        """nack_total{result="accepted"} for the commands judged since the last call: once per batch."""
        for subscription, accepted in self._accepted.items():
            self._metrics.child(self._metrics.nacks, subscription, "accepted").inc(accepted)
        self._accepted.clear()

    def _take_nacks(
        self,
        record: Message,
        command: MessageCommand,
        deliver_at: int | None,
        state: PartitionState,
        due_now: list[tuple[int, AcceptedNack]],
    ) -> tuple[str, ...]:
        """A cancel takes back the message's pending nack redeliveries, a reschedule moves them to
        `deliver_at`: an acceptance per subscription, written and indexed like a nack at the
        command's offset, supersedes each one (latest wins). Returns the subscriptions it applied to."""
        routes = self._routes().get(command.topic)
        if routes is None:
            return ()
        subs = command.named(s.name for s in routes.route.subscriptions)
        pending = self._nacks.pending_for(command.topic, command.partition, command.offset, subs)
        if not pending:
            return ()
        key = record.offset()
        source = (record.topic(), record.partition(), key)
        if deliver_at is None:  # a cancel, in force from its own timestamp
            deliver_at = record.timestamp()[1] if record.timestamp()[1] > 0 else self._clock.now_ms()
            markers = cancelled_acceptances(command, pending, deliver_at, source)
        else:
            markers = moved_acceptances(command, pending, deliver_at, source)
        for marker in markers:
            self._write_accepted(record, marker, state)
            self._accept(marker, key)
        if not state.tracker.add(key, deliver_at):
            due_now.extend((key, marker) for marker in markers)
        return tuple(pending)

    def _accept(self, accepted: AcceptedNack, key: int) -> None:
        """Put a judged acceptance in force; the pending nack it supersedes, if any, is counted now."""
        if self._nacks.accept(accepted, key):
            self._metrics.child(self._metrics.nacks, accepted.command.subscription, "superseded").inc()

    def _write_accepted(self, command: Message, accepted: AcceptedNack, state: PartitionState) -> None:
        """The durable word, in the command's own control partition: a line of the next `write`."""
        where = (command.topic(), command.partition())
        unwritten = self._unwritten.get(where)
        if unwritten is None:
            unwritten = self._unwritten[where] = (state, [])
        unwritten[1].append((command.key(), accepted.source[2], accepted.encode()))

    def write(self) -> None:
        """The acceptances judged since the last call, an accepted record per control partition
        (more past MAX_ACCEPTED_BYTES), keyed like its first command: one produce for a slice, not
        one per nack, and one record to read back. Called before the slice's due nacks go out, so
        before any checkpoint commits the commands' offsets. The member that wrote a record skips it
        when it comes back by its first command's offset."""
        headers = [(ACCEPTED_BY, self._group)]
        unwritten, self._unwritten = self._unwritten, {}
        for (topic, partition), (state, lines) in unwritten.items():
            start = 0
            while start < len(lines):
                end, size = start + 1, len(lines[start][2])
                while end < len(lines) and size + len(lines[end][2]) < MAX_ACCEPTED_BYTES:
                    size += len(lines[end][2]) + 1
                    end += 1
                key, offset, _ = lines[start]
                value = b"\n".join([line for _, _, line in lines[start:end]])
                self._writer.send(topic, key, value, headers, partition=partition)
                state.unread_facts.add(offset)
                start = end

    def _check_known_message(self, command: NackCommand, routes: Routes) -> None:
        """UNKNOWN_MESSAGE: the offset is not in the inbound topic, or not yet delivered to anyone."""
        key = (command.topic, command.partition)
        high = self._high_watermarks.get(key, -1)
        if command.offset >= high:
            try:
                _, high = self._reader.watermarks(command.topic, command.partition)
            except NoSuchPartition:
                high = -1
            self._high_watermarks[key] = high
        if command.offset >= high:
            raise RejectedRecord(
                UNKNOWN_MESSAGE,
                f"{command.topic}/{command.partition} has no offset {command.offset} (its end is {max(high, 0)})",
            )
        owner = self._partitions.get(key)
        sub = routes.route.subscription(command.subscription)
        not_yet = owner is not None and (
            (owner.next_offset is not None and command.offset >= owner.next_offset)
            or (sub is not None and not sub.ordered and owner.tracker.contains(command.offset))
        )
        if not_yet:
            raise RejectedRecord(
                UNKNOWN_MESSAGE,
                f"{command.topic}/{command.partition}@{command.offset} was not delivered to "
                f"{command.subscription!r} yet, so it cannot be nacked",
            )

    def reject(self, record: Message, rejected: RejectedRecord) -> None:
        dead_letter_topic, _ = side_topics(record.topic())
        self._writer.dead_letter(dead_letter_topic, record, rejected.code, rejected.message)
        logger.info(
            "nack rejected topic=%s partition=%d offset=%d code=%s",
            record.topic(),
            record.partition(),
            record.offset(),
            rejected.code,
        )
