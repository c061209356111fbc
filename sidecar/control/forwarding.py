"""Cancel and reschedule commands at the control partition's owner: refused here, or forwarded.

This owner checks what it can check alone (the topic, the subscription, the topic's policies, that
the offset exists) and answers a refusal itself. The rest goes on as a request to the message's
own inbound partition, whose owner decides in time or too late (cancels.py explains why there).
A command by key goes to the first partition the key may be on; that partition's owner finds the
key's pending record, or passes the request on to the other one (inbound/commands.py).
Requests carry no payload: a reschedule's copy is read from the original when it falls due.
"""

import logging
from collections.abc import Callable, Mapping

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.control.cancels import (
    COMMAND_BY,
    DELAYS_DISABLED,
    EXCEEDS_MAX_DELAY,
    FIXED_DELAY_TOPIC,
    NOT_DELAYED,
    NOT_KEYED,
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
from sidecar.control.key_partitions import key_partitions
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
        partitions: Callable[[], Mapping[str, int]],
    ) -> None:
        """`partitions`: the partition count of each topic (where a command by key may go)."""
        self._partitions = partitions
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
        source = (record.topic(), record.partition(), record.offset())
        if command.key is not None:
            first, *rest = key_partitions(command.key, self._partitions().get(command.topic, 1))
            relay = rest[0] if rest else None
            request = Request(command.kind, -1, command.subscription, command.id, deliver_at, source, record.key(),
                              by_key=command.key, relay=relay)  # fmt: skip
            self.send(command.topic, first, request)
            return
        if not self._exists(command.topic, command.partition, command.offset):
            self.refuse(record, command.ref, UNKNOWN_MESSAGE_OUTCOME, None, "the partition has no such offset")
            return
        nacks = take_nacks(record, command, deliver_at)
        request = Request(
            command.kind, command.offset, command.subscription, command.id, deliver_at, source, record.key(), nacks
        )
        self.send(command.topic, command.partition, request)

    def send(self, topic: str, partition: int, request: Request) -> None:
        """A request to the inbound partition whose owner decides it."""
        headers: OutHeaders = [(COMMAND_BY, self._group), (REQUEST, request.encode())]
        self._writer.send(topic, request.key, None, headers, partition=partition)

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
                message_key=command.key,
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
        if command.key is not None and not routes.route.delay.keyed:
            raise Refused(
                NOT_KEYED,
                f"{command.topic!r} is not keyed (by_key: replace), so no record is pending by key; "
                "name the message by 'partition' and 'offset'",
            )
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
