"""Due nacks out: the nacked message read back, to one subscription.

A nack leaves its tracker in (deliver-at, offset) order like any delivery, so the control
partition's delivered watermark covers it once it is redelivered, superseded or rejected.
"""

import logging
from collections import Counter, defaultdict
from collections.abc import Callable

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.control.acceptance import Acceptance
from sidecar.control.commands import (
    UNKNOWN_MESSAGE,
    UNKNOWN_SUBSCRIPTION,
    AcceptedNack,
)
from sidecar.control.nacks import LatestNacks
from sidecar.dispatch.reader import LogReader
from sidecar.dispatch.recent import RecentRecords
from sidecar.errors import RejectedRecord
from sidecar.metrics import Metrics
from sidecar.outbound.records import HeaderForm, outbound_headers
from sidecar.outbound.writer import Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState
from sidecar.policy.intake import Judge
from sidecar.policy.routes import Routes

logger = logging.getLogger(__name__)

# Most due nacks redelivered per loop turn, so intake keeps flowing while a burst drains.
MAX_NACK_DISPATCH = 50_000
# Held redeliveries read back together (see `Redelivery.redeliver`): each read of the log is a fresh
# assignment and a fetch round trip (20 to 100 ms here), so 90,000 nacks due when judged after a
# restart were redelivered at about 6,000 a second, one read per slice of 250 commands.
READ_BACK_BATCH = 5_000


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

    def dispatch_due(self, controls: list[PartitionState]) -> bool:
        """Redeliver due nacks; False when a tracker reported a due entry it could not pop.

        What an entry stands for is in `LatestNacks`, which holds every nack in force: the control
        log is not read back (an entry that stands for nothing in force was superseded)."""
        found: list[tuple[int, AcceptedNack]] = []
        stalled = False
        for state in controls:
            if state.tracker.has_message_available():
                due = state.tracker.pop_due(MAX_NACK_DISPATCH)
                if not due:
                    stalled = True
                for entry in due:
                    found += [
                        (entry.offset, nack) for nack in self._nacks.due(state.topic, state.partition, entry.offset)
                    ]
        if found:
            self.redeliver(found)
        return not stalled

    def redeliver(self, accepted: list[tuple[int, AcceptedNack]], hold_reads: bool = False) -> None:
        """[(index key, nack)]: the ones still in force go out now, in that order.

        `hold_reads`: those whose payloads must be read back from the log are held until `release`
        (or until READ_BACK_BATCH are held) and read back in one read. For the commands of a
        consumed batch that were due when judged, which after a restart would otherwise read their
        payloads back a slice of 250 at a time. The caller releases them before anything is committed."""
        out, wanted = self._claim(accepted)
        if not out:
            return
        found, missing = self._recent.take(wanted)
        self._count_reads(found, missing)
        records = {(key, offset): message for key, offset, message in found}
        if missing and hold_reads:
            ready: list[AcceptedNack] = []
            for nack in out:
                command = nack.command
                (ready if ((command.topic, command.partition), command.offset) in records else self._held).append(nack)
            for key, offsets in missing.items():
                self._held_wanted.setdefault(key, []).extend(offsets)
            self._send(ready, records)
            if len(self._held) >= READ_BACK_BATCH:
                self.release()
            return
        if missing:
            records.update(((key, offset), message) for key, offset, message in self._reader.read(missing))
        self._send(out, records)

    def release(self) -> None:
        """The redeliveries `redeliver` held, their payloads read back in one read."""
        if not self._held:
            return
        held, wanted = self._held, self._held_wanted
        self._held, self._held_wanted = [], {}
        self._send(held, {(key, offset): message for key, offset, message in self._reader.read(wanted)})

    def _claim(
        self, accepted: list[tuple[int, AcceptedNack]]
    ) -> tuple[list[AcceptedNack], dict[TopicPartitionKey, list[int]]]:
        """The nacks still in force, settled now, and the inbound offsets they redeliver."""
        claim = self._nacks.claim
        out: list[AcceptedNack] = []
        wanted: dict[TopicPartitionKey, dict[int, None]] = {}
        for offset, nack in accepted:
            if not claim(nack, offset):
                continue  # superseded (counted when it was)
            command = nack.command
            if nack.cancelled:  # the pending nack it superseded is taken back: nothing goes out
                self._metrics.nacks.labels(command.subscription, "cancelled").inc()
                continue
            out.append(nack)
            key = (command.topic, command.partition)
            offsets = wanted.get(key)
            if offsets is None:
                offsets = wanted[key] = {}
            offsets[command.offset] = None
        return out, {key: list(offsets) for key, offsets in wanted.items()}

    def _send(self, out: list[AcceptedNack], records: dict[tuple[TopicPartitionKey, int], Message | None]) -> None:
        """Write each nack's redelivery (or dead-letter its command); counted and observed once per
        batch: a burst of nacks redelivers tens of thousands at once."""
        sent: Counter[tuple[str, str]] = Counter()
        deliver_ats: dict[str, list[int]] = defaultdict(list)
        routes = self._routes()
        for nack in out:
            command = nack.command
            message = records.get(((command.topic, command.partition), command.offset))
            if self._redeliver(nack, message, routes.get(command.topic)):
                sent[(command.topic, command.subscription)] += 1
                deliver_ats[command.topic].append(nack.deliver_at)
        metrics = self._metrics
        for (topic, subscription), count in sent.items():
            metrics.child(metrics.redeliveries, subscription).inc(count)
            metrics.child(metrics.delivered, topic, subscription).inc(count)
        now = self._clock.now_ms()  # after the last write: no redelivery counts as less late than it was
        for topic, ats in deliver_ats.items():
            metrics.observe_many(metrics.child(metrics.lateness, topic), [max(now - at, 0) / 1000 for at in ats])

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

    def _redeliver(self, nack: AcceptedNack, message: Message | None, routes: Routes | None) -> bool:
        """Write one redelivery; False when it was rejected instead (dead-lettered with its command)."""
        command = nack.command
        sub = routes.route.subscription(command.subscription) if routes is not None else None
        try:
            if routes is None or sub is None:
                raise RejectedRecord(UNKNOWN_SUBSCRIPTION, "the subscription left the policies before redelivery")
            if message is None:
                raise RejectedRecord(UNKNOWN_MESSAGE, "the message is no longer in the inbound log (retention)")
            owner = self._partitions.get((command.topic, command.partition))
            rule = owner.rules.at(command.offset) if owner is not None else None
            rule = rule or routes.rule(self._retention_ms.get(command.topic))
            fate = self._judge(rule, message.headers(), max(message.timestamp()[1], 0))
            if fate.rejected is not None:
                raise RejectedRecord(
                    UNKNOWN_MESSAGE,
                    f"the message went to the dead-letter topic ({fate.rejected.code}), never to "
                    f"{command.subscription!r}",
                )
        except RejectedRecord as rejected:
            self._reject(nack, rejected)
            self._metrics.nacks.labels(command.subscription, rejected.code.lower()).inc()
            return False
        headers = outbound_headers(
            message.headers(),
            command.topic,
            command.partition,
            command.offset,
            nack.deliver_at,
            command.redelivery_count + 1,
            self._header_form,
        )
        outbound = sub.outbound
        self._writer.send(
            outbound, message.key(), message.value(), headers, self._writer.target(outbound, command.partition)
        )
        return True

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
