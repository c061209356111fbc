"""Cancel and reschedule commands at the control partition's owner: refused here, or forwarded.

This owner checks what it can check alone (the topic, the subscription, the topic's policies, that
the offset exists) and answers a refusal itself. The rest goes on as a request to the message's
own inbound partition, whose owner decides in time or too late (cancels.py explains why there).
Requests carry no payload: a reschedule's copy is read from the original when it falls due.
"""

import logging
from collections.abc import Callable

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.control.cancels import (
    COMMAND_BY,
    DELAYS_DISABLED,
    EXCEEDS_MAX_DELAY,
    FIXED_DELAY_TOPIC,
    NOT_DELAYED,
    REJECTED,
    REQUEST,
    UNKNOWN_MESSAGE_OUTCOME,
    UNKNOWN_SUBSCRIPTION,
    UNKNOWN_TOPIC,
    CommandRef,
    MessageCommand,
    OutcomeRecord,
    Request,
)
from sidecar.control.outcomes import Outcomes
from sidecar.control.topics import ControlTopics
from sidecar.dispatch.reader import LogReader, NoSuchPartition
from sidecar.durations import format_duration_ms
from sidecar.errors import Refused
from sidecar.outbound.records import OutHeaders
from sidecar.outbound.writer import Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.policy.routes import Routes

logger = logging.getLogger(__name__)

TakeNacks = Callable[[Message, MessageCommand, int | None], tuple[str, ...]]
"""Cancel a message's pending nacks, or move them to a reschedule's new deliver-at (at the control
partition's owner); the subscriptions they were for."""


class Forwarding:
    def __init__(
        self,
        group_id: str,
        writer: Writer,
        reader: LogReader,
        routes: Callable[[], dict[str, Routes]],
        outcomes: Outcomes,
        clock: Clock,
        controls: ControlTopics,
    ) -> None:
        self._controls = controls
        self._group = group_id.encode()
        self._writer = writer
        self._reader = reader
        self._routes = routes
        self._outcomes = outcomes
        self._clock = clock
        self._ends: dict[TopicPartitionKey, int] = {}

    def take(self, record: Message, command: MessageCommand, take_nacks: TakeNacks) -> None:
        """Check one command: refuse it here, or forward it to the message's partition.

        A cancel first takes back the message's pending nack redeliveries, and a reschedule moves
        them, as this member holds them: commands for one message share its key, so its nacks are in
        this control partition."""
        sent_ms = record.timestamp()[1]
        if sent_ms <= 0:
            sent_ms = self._clock.now_ms()
        try:
            self._controls.check(record.topic(), command.topic)
            deliver_at = self._check(command, sent_ms)
        except Refused as rejected:
            self.refuse(record, command.ref, REJECTED, rejected.code, rejected.message)
            return
        if not self._exists(command.topic, command.partition, command.offset):
            self.refuse(record, command.ref, UNKNOWN_MESSAGE_OUTCOME, None, "the partition has no such offset")
            return
        source = (record.topic(), record.partition(), record.offset())
        nacks = take_nacks(record, command, deliver_at)
        request = Request(
            command.kind, command.offset, command.subscription, command.id, deliver_at, source, record.key(), nacks
        )
        headers: OutHeaders = [(COMMAND_BY, self._group), (REQUEST, request.encode())]
        self._writer.send(command.topic, record.key(), None, headers, partition=command.partition)

    def refuse(self, record: Message, command: CommandRef, outcome: str, code: str | None, message: str) -> None:
        """Answer a command that goes no further (a malformed one: what could be read of it, `loose_command`)."""
        self._outcomes.send(
            record.key(),
            OutcomeRecord(
                outcome,  # type: ignore[arg-type]
                command.kind,
                command.topic,
                command.partition,
                command.offset,
                command.id,
                (record.topic(), record.partition(), record.offset()),
                code=code,
                message=message,
            ),
        )
        logger.info(
            "command refused topic=%s partition=%d offset=%d outcome=%s code=%s",
            record.topic(),
            record.partition(),
            record.offset(),
            outcome,
            code,
        )

    def _check(self, command: MessageCommand, sent_ms: int) -> int | None:
        """The checks that need only the policies; returns a reschedule's new deliver-at."""
        routes = self._routes().get(command.topic)
        if routes is None:
            raise Refused(UNKNOWN_TOPIC, f"the sidecar serves no topic {command.topic!r}")
        if command.subscription is not None:
            sub = routes.route.subscription(command.subscription)
            if sub is None:
                raise Refused(
                    UNKNOWN_SUBSCRIPTION, f"topic {command.topic!r} has no subscription {command.subscription!r}"
                )
            if sub.ordered:
                raise Refused(
                    NOT_DELAYED,
                    f"{command.subscription!r} is {sub.type}: it ignores delays and got every message at once",
                )
        if command.kind == "cancel":
            return None
        delay = routes.route.delay
        if not delay.is_enabled:
            raise Refused(DELAYS_DISABLED, f"delayed delivery is disabled for {command.topic!r}")
        if delay.fixed_ms > 0:
            raise Refused(
                FIXED_DELAY_TOPIC,
                f"{command.topic!r} has a fixed delivery delay of {format_duration_ms(delay.fixed_ms)} "
                f"(from {delay.fixed_delivery_delay.source}); its messages cannot be moved",
            )
        deliver_at = command.new_deliver_at(sent_ms)
        if delay.max_ms > 0 and deliver_at - sent_ms > delay.max_ms:
            raise Refused(
                EXCEEDS_MAX_DELAY,
                f"the new time is {format_duration_ms(deliver_at - sent_ms)} away, over the max delivery delay "
                f"{format_duration_ms(delay.max_ms)} (from {delay.max_delivery_delay.source})",
            )
        return deliver_at

    def _exists(self, topic: str, partition: int, offset: int) -> bool:
        """Whether the offset is below the partition's end (read again only when it is not below the one known)."""
        key = (topic, partition)
        if offset < self._ends.get(key, -1):
            return True
        try:
            _, end = self._reader.watermarks(topic, partition)
        except NoSuchPartition:
            end = -1
        self._ends[key] = end
        return offset < end
