"""Client helpers to take back or move a scheduled message, and to learn whether it was in time.

Written against the external contract (docs/contract.md, section 5) and confluent-kafka alone, like
sidecar.client. The usual order is: open an `OutcomeReader` (it starts at the outcomes topic's end),
send the commands with a `Canceller`, flush, then `wait` for their answers by command id.

    reader = OutcomeReader({"bootstrap.servers": "kafka:9092"})
    canceller = Canceller(Producer({"bootstrap.servers": "kafka:9092"}))
    command_id = canceller.cancel("orders/3/1042")
    canceller.flush()
    print(reader.wait([command_id])[command_id].outcome)  # cancelled, too-late, ...
"""

import base64
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from sidecar.client import (
    COMMAND_VERSION,
    CONTROL_TOPIC,
    CommandWriter,
    MessageId,
    Record,
    _duration_ms,
    _epoch_ms,
    origin,
)

__all__ = ["ByKey", "Canceller", "Outcome", "OutcomeReader"]

OUTCOMES_SUFFIX = ".outcomes"


@dataclass(frozen=True)
class ByKey:
    """A keyed topic's pending record for a key (`by_key: replace`, contract section 2): what a
    command names when the producer kept no offset. A str key is sent as UTF-8."""

    topic: str
    key: bytes | str

    def fields(self) -> dict[str, str]:
        """The command's fields naming the message: `key` for UTF-8, else `key_base64`."""
        raw = self.key.encode() if isinstance(self.key, str) else self.key
        if not raw:
            raise ValueError("an empty key names no record: producers place it as no key")
        try:
            return {"topic": self.topic, "key": raw.decode()}
        except UnicodeDecodeError:
            return {"topic": self.topic, "key_base64": base64.b64encode(raw).decode()}

    def __str__(self) -> str:
        raw = self.key.encode() if isinstance(self.key, str) else self.key
        return f"{self.topic}/key/{base64.b64encode(raw).decode()}"


Message = MessageId | Record | ByKey | str
"""What a command names: a message id (or its text, or an outbound record's origin), or a key."""


def _message_id(message: MessageId | Record | str) -> MessageId:
    if isinstance(message, MessageId):
        return message
    if isinstance(message, str):
        parts = message.rsplit("/", 2)
        if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{message!r} is not a message id (topic/partition/offset)")
        return MessageId(parts[0], int(parts[1]), int(parts[2]))
    return origin(message)


class Canceller(CommandWriter):
    """Sends cancel and reschedule commands. Each call returns the command's id, which its outcome carries.

    A message is named by its id: a MessageId, an outbound record (its origin), or the text
    `topic/partition/offset` that a producer learns from its delivery report; or, on a keyed topic,
    by its key (`ByKey`). Like nacks, commands are keyed by the message id (by key: `topic/key/<the
    key in base64>`), so the commands about one message are read in the order they were sent.
    """

    def cancel(self, message: Message, *, subscription: str | None = None, command_id: str | None = None) -> str:
        """Take the message back from `subscription`, or from every subscription it is owed to."""
        return self._send(message, "cancel", {}, subscription, command_id)

    def reschedule(
        self,
        message: Message,
        delay: int | timedelta,
        *,
        subscription: str | None = None,
        command_id: str | None = None,
    ) -> str:
        """Deliver the message `delay` (ms or timedelta) after the command's timestamp instead."""
        return self._send(message, "reschedule", {"delay_ms": _duration_ms(delay, "delay")}, subscription, command_id)

    def reschedule_at(
        self,
        message: Message,
        deliver_at_ms: int | datetime,
        *,
        subscription: str | None = None,
        command_id: str | None = None,
    ) -> str:
        """Deliver the message at an instant (epoch ms or an aware datetime) instead."""
        when = {"deliver_at": _epoch_ms(deliver_at_ms, "deliver_at_ms")}
        return self._send(message, "reschedule", when, subscription, command_id)

    def _send(
        self,
        message: Message,
        kind: str,
        when: dict[str, int],
        subscription: str | None,
        command_id: str | None,
    ) -> str:
        message_id: MessageId | ByKey
        names: dict[str, object]
        if isinstance(message, ByKey):
            message_id, names = message, dict(message.fields())
        else:
            message_id = _message_id(message)
            names = {"topic": message_id.topic, "partition": message_id.partition, "offset": message_id.offset}
        if subscription is not None and not subscription:
            raise ValueError("subscription must not be empty; pass None for every subscription")
        command_id = command_id or uuid.uuid4().hex
        command: dict[str, object] = {"v": COMMAND_VERSION, "type": kind, **names, "id": command_id, **when}
        if subscription is not None:
            command["subscription"] = subscription

        def delivered(err: Any, _: Any) -> None:
            if err is not None:
                self._failures.append(f"{kind} {message_id} ({command_id}): {err}")

        value = json.dumps(command, separators=(",", ":")).encode()
        self._producer.produce(self.control_topic, value=value, key=str(message_id).encode(), on_delivery=delivered)
        return command_id


@dataclass(frozen=True)
class Outcome:
    """One answer from `<control topic>.outcomes` (contract section 5)."""

    outcome: str
    """cancelled, rescheduled, too-late, unknown-message or rejected."""
    id: str | None
    topic: str | None
    partition: int | None
    offset: int | None
    code: str | None = None
    message: str | None = None
    deliver_at: int | None = None
    delivered_at: int | None = None
    subscriptions: tuple[str, ...] = ()
    too_late: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def decode(cls, value: bytes | None) -> "Outcome | None":
        try:
            data = json.loads(value or b"")
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("outcome"), str):
            return None
        return cls(
            data["outcome"],
            data.get("id"),
            data.get("topic"),
            data.get("partition"),
            data.get("offset"),
            data.get("code"),
            data.get("message"),
            data.get("deliver_at"),
            data.get("delivered_at"),
            tuple(data.get("subscriptions") or ()),
            tuple(data.get("too_late") or ()),
            data,
        )


OPEN_TIMEOUT_S = 30.0
LEADER_MOVING = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError._UNKNOWN_PARTITION,
        # Three nodes on two cores: a busy leader answered a watermark request after more than 10 s
        # (the 3-node end-to-end run of 2026-11-28 stopped there), so a timeout is asked again too.
        KafkaError._TIMED_OUT,
        # A single node under a load average of 90 answered these for a moment too.
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TRANSPORT,
    }
)
"""Answers of a partition whose leader moves or is not known yet, or of a broker too busy to answer."""


def watermark_offsets(consumer: Consumer, partition: TopicPartition, deadline_s: float = 60.0) -> tuple[int, int]:
    """(low, high) from the broker; a leader that moves or is not known yet (a topic the sidecar just
    created) is asked again until `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(partition, timeout=10, cached=False)
            return int(low), int(high)
        except KafkaException as e:
            if (not e.args[0].retriable() and e.args[0].code() not in LEADER_MOVING) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def topic_ends(consumer: Consumer, topic: str, timeout_s: float) -> list[TopicPartition]:
    """Each partition of `topic` at its high watermark. A topic the sidecar has just created can be
    in the metadata before its partitions have a leader: a reader opened then was answered
    NOT_LEADER_FOR_PARTITION (a clean-clone CI run, 2026-11-30). Such answers are asked again until
    `timeout_s`; a topic that does not exist is an error at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = consumer.list_topics(topic, timeout=10).topics.get(topic)
        error = found.error if found is not None else None
        if found is None or (error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART if error else not found.partitions):
            raise KafkaException(f"the outcomes topic {topic} does not exist yet; start the sidecar first")
        if error is None:
            left = max(deadline - time.monotonic(), 0.0)
            return [
                TopicPartition(topic, p, watermark_offsets(consumer, TopicPartition(topic, p), left)[1])
                for p in sorted(found.partitions)
            ]
        if error.code() not in LEADER_MOVING or time.monotonic() > deadline:
            raise KafkaException(error)
        time.sleep(0.2)


class OutcomeReader:
    """Reads answers from the outcomes topic, from its end at the time this reader was opened.

    read_committed: with the sidecar in exactly-once mode, an answer is seen once its decision is
    committed, and only then.
    """

    def __init__(
        self, config: dict[str, Any], control_topic: str = CONTROL_TOPIC, open_timeout_s: float = OPEN_TIMEOUT_S
    ) -> None:
        """`open_timeout_s`: how long a topic whose partitions have no leader yet is waited for."""
        self.topic = control_topic + OUTCOMES_SUFFIX
        self._consumer = Consumer(
            {
                **config,
                "group.id": config.get("group.id") or f"outcomes-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        self._seen: dict[str, Outcome] = {}
        try:
            self._consumer.assign(topic_ends(self._consumer, self.topic, open_timeout_s))
        except BaseException:
            self._consumer.close()
            raise

    def wait(self, command_ids: Iterable[str], timeout_s: float = 30.0) -> dict[str, Outcome]:
        """The answers to these commands, as they come; those missing at the timeout are left out."""
        wanted = set(command_ids)
        deadline = time.monotonic() + timeout_s
        while not wanted <= self._seen.keys() and time.monotonic() < deadline:
            for record in self._consumer.consume(500, 0.2):
                if record.error() is not None:
                    continue
                outcome = Outcome.decode(record.value())
                if outcome is not None and outcome.id is not None:
                    self._seen[outcome.id] = outcome
        return {i: self._seen[i] for i in wanted if i in self._seen}

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> "OutcomeReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
