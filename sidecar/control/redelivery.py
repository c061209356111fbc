"""Due nacks out: the nacked message read back, to one subscription.

A nack leaves its tracker in (deliver-at, offset) order like any delivery, so the control
partition's delivered watermark covers it once it is redelivered, superseded or rejected. The
redelivery of a nack accepted shortly before its deliver-at is built when it is accepted
(`prepare`, prepared.py), so at due time only the write is left.
"""

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from confluent_kafka import KafkaException, Message

from sidecar.clock import Clock
from sidecar.control.acceptance import Acceptance
from sidecar.control.commands import (
    UNKNOWN_MESSAGE,
    UNKNOWN_SUBSCRIPTION,
    AcceptedNack,
)
from sidecar.control.nacks import LatestNacks
from sidecar.control.prepared import PREPARE_AHEAD_MS, Out, Prepared
from sidecar.dispatch.reader import LogReader
from sidecar.dispatch.recent import RecentRecords
from sidecar.errors import RejectedRecord
from sidecar.metrics import Metrics
from sidecar.outbound.records import DELIVER_AT, ORIGIN, REDELIVERY_COUNT, HeaderForm, OutHeaders, outbound_headers
from sidecar.outbound.writer import Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.metadata import RuleHistory
from sidecar.partitions.state import PartitionState
from sidecar.policy.headers import Headers
from sidecar.policy.intake import Fate, Judge
from sidecar.policy.routes import IntakeRule, Routes

logger = logging.getLogger(__name__)

# Most due nacks redelivered per loop turn, so intake keeps flowing while a burst drains.
MAX_NACK_DISPATCH = 50_000
# Held redeliveries read back together (see `Redelivery.redeliver`): each read of the log is a fresh
# assignment and a fetch round trip (20 to 100 ms here), so 90,000 nacks due when judged after a
# restart were redelivered at about 6,000 a second, one read per slice of 250 commands.
READ_BACK_BATCH = 5_000


Payloads = dict[TopicPartitionKey, dict[int, Message | None]]
"""Payloads read for redelivery, per inbound partition by offset (None: gone from the log)."""
_LEFT = "the subscription left the policies before redelivery"
_GONE = "the message is no longer in the inbound log (retention)"


def _by_partition(nacks: list[AcceptedNack]) -> dict[TopicPartitionKey, list[AcceptedNack]]:
    """Nacks grouped by the inbound partition of their messages, in order."""
    grouped: dict[TopicPartitionKey, list[AcceptedNack]] = {}
    for nack in nacks:
        command = nack.command
        key = (command.topic, command.partition)
        group = grouped.get(key)
        if group is None:
            group = grouped[key] = []
        group.append(nack)
    return grouped


def _add(records: Payloads, read: Iterable[tuple[TopicPartitionKey, int, Message | None]]) -> Payloads:
    """`records` with the (partition, offset, record) of a read (or of those kept since intake) added."""
    for partition, offset, message in read:
        found = records.get(partition)
        if found is None:
            found = records[partition] = {}
        found[offset] = message
    return records


class Redelivery:
    def __init__(
        self,
        acceptance: Acceptance,
        writer: Writer,
        reader: LogReader,
        recent: RecentRecords,
        partitions: dict[TopicPartitionKey, PartitionState],
        routes: Callable[[], dict[str, Routes]],
        retention_ms: dict[str, int | None],
        nacks: LatestNacks,
        metrics: Metrics,
        clock: Clock,
        header_form: HeaderForm = "compact",
    ) -> None:
        self._header_form = header_form
        self._acceptance = acceptance
        self._writer = writer
        self._reader = reader
        self._recent = recent
        self._partitions = partitions
        self._routes = routes
        self._retention_ms = retention_ms
        self._nacks = nacks
        self._metrics = metrics
        self._clock = clock
        self._judge = Judge()
        self._held: list[AcceptedNack] = []
        """Nacks claimed and waiting for their payloads to be read back (see `redeliver`)."""
        self._held_wanted: dict[TopicPartitionKey, list[int]] = {}
        self._prepared = Prepared(clock)
        """Redeliveries built at acceptance (`prepare`)."""

    def dispatch_due(self, controls: list[PartitionState]) -> bool:
        """Redeliver due nacks; False when a tracker reported a due entry it could not pop.

        What an entry stands for is in `LatestNacks`, which holds every nack in force: the control
        log is not read back (an entry that stands for nothing in force was superseded)."""
        settled: list[AcceptedNack] = []
        stalled = False
        settle = self._nacks.settle_due
        for state in controls:
            if state.tracker.has_message_available():
                due = state.tracker.pop_due(MAX_NACK_DISPATCH)
                if not due:
                    stalled = True
                topic, partition = state.topic, state.partition
                for entry in due:
                    settled += settle(topic, partition, entry.offset)
        if settled:
            self._redeliver_settled(settled)
        self._prepared.sweep()
        return not stalled

    def prepare(self, accepted: list[AcceptedNack]) -> None:
        """Nacks just accepted and indexed for later: the redeliveries of those due within
        PREPARE_AHEAD_MS whose messages are still kept since intake are built now, and written at
        due time if the acceptance is still in force then (prepared.py). Anything not built here
        (refused, not kept, further ahead) is built at due time."""
        routes, prepared = self._routes(), self._prepared
        prepared.under(routes)
        room = prepared.room
        if room <= 0 or not accepted:
            return
        until = self._clock.now_ms() + PREPARE_AHEAD_MS
        soon = [nack for nack in accepted if nack.deliver_at <= until and not nack.cancelled][:room]
        if not soon:
            return
        found, _ = self._recent.take(self._offsets(soon))
        records = _add({}, found)
        for partition, nacks in _by_partition(soon).items():
            kept = records.get(partition)
            if kept:
                for nack, out in self._build(partition, nacks, routes.get(partition[0]), kept, refuse=False):
                    prepared.put(nack, partition, out)

    def forget(self, partition: TopicPartitionKey) -> None:
        """An inbound partition gone to another member."""
        self._prepared.forget(partition)

    def redeliver(self, accepted: list[tuple[int, AcceptedNack]], hold_reads: bool = False) -> None:
        """[(index key, nack)]: the ones still in force go out now, in that order.

        `hold_reads`: those whose payloads must be read back from the log are held until `release`
        (or until READ_BACK_BATCH are held) and read back in one read. For the commands of a
        consumed batch that were due when judged, which after a restart would otherwise read their
        payloads back a slice of 250 at a time. The caller releases them before anything is committed."""
        self._redeliver_settled([nack for offset, nack in accepted if self._nacks.claim(nack, offset)], hold_reads)

    def _redeliver_settled(self, settled: list[AcceptedNack], hold_reads: bool = False) -> None:
        """`redeliver` of nacks claimed already (superseded ones left out)."""
        out = self._redelivering(settled)
        if not out:
            return
        prepared = self._prepared
        prepared.under(self._routes())
        wanted = self._offsets([n for n in out if n not in prepared] if prepared else out)
        found, missing = self._recent.take(wanted)
        self._count_reads(found, missing)
        records = _add({}, found)
        if missing and hold_reads:
            now: list[AcceptedNack] = []
            for nack in out:
                command = nack.command
                kept = records.get((command.topic, command.partition), {})
                (now if command.offset in kept or nack in prepared else self._held).append(nack)
            for key, offsets in missing.items():
                self._held_wanted.setdefault(key, []).extend(offsets)
            self._send(now, records)
            if len(self._held) >= READ_BACK_BATCH:
                self.release()
            return
        if missing:
            _add(records, self._reader.read(missing))
        self._send(out, records)

    def release(self) -> None:
        """The redeliveries `redeliver` held, their payloads read back in one read."""
        if not self._held:
            return
        held, wanted = self._held, self._held_wanted
        self._held, self._held_wanted = [], {}
        self._send(held, _add({}, self._reader.read(wanted)))

    def _redelivering(self, settled: list[AcceptedNack]) -> list[AcceptedNack]:
        """The settled nacks that redeliver: not a cancel's, which takes back the nack it superseded."""
        if not any(nack.cancelled for nack in settled):
            return settled
        for nack in settled:
            if nack.cancelled:
                self._metrics.nacks.labels(nack.command.subscription, "cancelled").inc()
        return [nack for nack in settled if not nack.cancelled]

    @staticmethod
    def _offsets(nacks: list[AcceptedNack]) -> dict[TopicPartitionKey, list[int]]:
        """The inbound offsets these nacks redeliver, per inbound partition."""
        wanted: dict[TopicPartitionKey, dict[int, None]] = {}
        for nack in nacks:
            command = nack.command
            key = (command.topic, command.partition)
            offsets = wanted.get(key)
            if offsets is None:
                offsets = wanted[key] = {}
            offsets[command.offset] = None
        return {key: list(offsets) for key, offsets in wanted.items()}

    def _send(self, out: list[AcceptedNack], records: Payloads) -> None:
        """Write each nack's redelivery (or dead-letter its command), in order within each inbound
        partition; counted and observed once per batch. What is the same for a partition's nacks (its
        routes, rules, outbound partition and origin prefix) is looked up once: a burst of nacks
        redelivers tens of thousands at once."""
        sent: Counter[tuple[str, str]] = Counter()
        deliver_ats: dict[str, list[int]] = defaultdict(list)
        routes = self._routes()
        self._prepared.under(routes)
        for key, nacks in _by_partition(out).items():
            self._send_partition(key, nacks, routes.get(key[0]), records.get(key, {}), sent, deliver_ats[key[0]])
        metrics = self._metrics
        for (topic, subscription), count in sent.items():
            metrics.child(metrics.redeliveries, subscription).inc(count)
            metrics.child(metrics.delivered, topic, subscription).inc(count)
        now = self._clock.now_ms()  # after the last write: no redelivery counts as less late than it was
        for topic, ats in deliver_ats.items():
            if ats:
                metrics.observe_many(metrics.child(metrics.lateness, topic), [max(now - at, 0) / 1000 for at in ats])

    def _send_partition(
        self,
        partition: TopicPartitionKey,
        nacks: list[AcceptedNack],
        routes: Routes | None,
        records: dict[int, Message | None],
        sent: Counter[tuple[str, str]],
        deliver_ats: list[int],
    ) -> None:
        """The redeliveries of one inbound partition's messages, in order: built at acceptance
        (`prepare`), or now."""
        outs = [self._prepared.pop(nack) for nack in nacks]
        todo = [nack for nack, out in zip(nacks, outs, strict=True) if out is None]
        prepared = len(nacks) - len(todo)
        if todo:  # built now; those refused are left out
            built = {id(n): out for n, out in self._build(partition, todo, routes, records)}
            outs = [out if out is not None else built.get(id(n)) for n, out in zip(nacks, outs, strict=True)]
        topic = partition[0]
        writer = self._writer
        produce = writer.producer.produce
        by_sub: dict[str, int] = {}
        for nack, out in zip(nacks, outs, strict=True):
            if out is None:
                continue  # refused
            outbound, target, key, value, headers = out
            try:
                produce(outbound, value, key, headers=headers, partition=target)
            except (BufferError, KafkaException):  # a full queue waits; a fenced producer raises Fenced
                writer.send(outbound, key, value, headers, target)
            subscription = nack.command.subscription
            by_sub[subscription] = by_sub.get(subscription, 0) + 1
            deliver_ats.append(nack.deliver_at)
        for subscription, count in by_sub.items():
            sent[(topic, subscription)] += count
        if prepared:
            self._metrics.child(self._metrics.payload_reads, topic, "recent").inc(prepared)

    def _build(
        self,
        partition: TopicPartitionKey,
        nacks: list[AcceptedNack],
        routes: Routes | None,
        records: dict[int, Message | None],
        refuse: bool = True,
    ) -> list[tuple[AcceptedNack, Out]]:
        """The redeliveries of one inbound partition's messages, as they are written. A message is
        judged again under the rule it was taken with, so one that went to the dead-letter topic is
        never delivered. `refuse`: the nacks that cannot be redelivered are refused (at due time),
        else only left out (when built ahead)."""
        if not nacks:
            return []
        if routes is None:
            if refuse:
                for nack in nacks:
                    self._refuse(nack, RejectedRecord(UNKNOWN_SUBSCRIPTION, _LEFT))
            return []
        topic, number = partition
        owner = self._partitions.get(partition)
        rules = owner.rules if owner is not None else None
        current = routes.rule(self._retention_ms.get(topic))
        compact = self._header_form == "compact"
        prefix = f"{topic}/{number}/".encode()
        found = self._sendable(partition, nacks, routes, records, refuse)
        judged = [(message.headers(), max(message.timestamp()[1], 0)) for _, _, message in found]
        fates = self._fates(rules, current, [nack for nack, _, _ in found], judged)
        built: list[tuple[AcceptedNack, Out]] = []
        for (nack, (outbound, target), message), (original, _), fate in zip(found, judged, fates, strict=True):
            command = nack.command
            subscription, offset = command.subscription, command.offset
            if fate.rejected is not None:
                if refuse:
                    reason = (
                        f"the message went to the dead-letter topic ({fate.rejected.code}), never to {subscription!r}"
                    )
                    self._refuse(nack, RejectedRecord(UNKNOWN_MESSAGE, reason))
                continue
            count = command.redelivery_count + 1
            headers: OutHeaders
            if compact:  # outbound_headers' compact form, inlined: the count is always above 0 here
                headers = [(k, v if v is not None else b"") for k, v in original] if original else []
                headers.append((ORIGIN, prefix + b"%d" % offset))
                headers.append((DELIVER_AT, b"%d" % nack.deliver_at))
                headers.append((REDELIVERY_COUNT, b"%d" % count))
            else:
                headers = outbound_headers(original, topic, number, offset, nack.deliver_at, count, "v1")
            built.append((nack, (outbound, target, message.key(), message.value(), headers)))
        return built

    def _sendable(
        self,
        partition: TopicPartitionKey,
        nacks: list[AcceptedNack],
        routes: Routes,
        records: dict[int, Message | None],
        refuse: bool,
    ) -> list[tuple[AcceptedNack, tuple[str, int], Message]]:
        """(nack, (outbound topic, outbound partition), message) of the nacks whose subscription is
        still in the policies and whose message was found; the others are refused here (`refuse`)."""
        outs: dict[str, tuple[str, int] | None] = {}
        found: list[tuple[AcceptedNack, tuple[str, int], Message]] = []
        for nack in nacks:
            command = nack.command
            subscription = command.subscription
            if subscription in outs:
                out = outs[subscription]
            else:
                sub = routes.route.subscription(subscription)
                out = None if sub is None else (sub.outbound, self._writer.target(sub.outbound, partition[1]))
                outs[subscription] = out
            message = records.get(command.offset)
            if out is not None and message is not None:
                found.append((nack, out, message))
            elif refuse and out is None:
                self._refuse(nack, RejectedRecord(UNKNOWN_SUBSCRIPTION, _LEFT))
            elif refuse:
                self._refuse(nack, RejectedRecord(UNKNOWN_MESSAGE, _GONE))
        return found

    def _fates(
        self,
        rules: RuleHistory | None,
        current: IntakeRule,
        nacks: list[AcceptedNack],
        judged: list[tuple[Headers, int]],
    ) -> list[Fate]:
        """The messages judged again, each under the rule it was taken with: as one list when one
        rule covers the whole partition (the common case)."""
        if rules is None:
            return self._judge.many(current, judged)
        if rules.single is not None:
            return self._judge.many(rules.single, judged)
        return [self._judge(rules.at(n.command.offset) or current, *j) for n, j in zip(nacks, judged, strict=True)]

    def _refuse(self, nack: AcceptedNack, rejected: RejectedRecord) -> None:
        self._reject(nack, rejected)
        self._metrics.nacks.labels(nack.command.subscription, rejected.code.lower()).inc()

    def _count_reads(
        self, found: list[tuple[TopicPartitionKey, int, Message]], missing: dict[TopicPartitionKey, list[int]]
    ) -> None:
        """payload_reads_total: kept since intake (recent), or read back from the log."""
        metrics = self._metrics
        kept = Counter(key[0] for key, _, _ in found)
        for topic, count in kept.items():
            metrics.child(metrics.payload_reads, topic, "recent").inc(count)
        for (topic, _), offsets in missing.items():
            metrics.child(metrics.payload_reads, topic, "log").inc(len(offsets))

    def _reject(self, nack: AcceptedNack, rejected: RejectedRecord) -> None:
        """The command, unchanged, to the control dead-letter topic (read back: this path is rare)."""
        topic, partition, offset = nack.source
        command = self._reader.read_one(topic, partition, offset)
        if command is not None:
            self._acceptance.reject(command, rejected)
        else:
            logger.error(
                "nack rejected at redelivery but its command is gone from the control log "
                "topic=%s partition=%d offset=%d code=%s",
                topic,
                partition,
                offset,
                rejected.code,
            )
