"""Client helpers for the delay sidecar's users: producers that ask for a delay, consumers that nack.

This module is written against the external contract (docs/contract.md, sections 1, 4 and 5) and
confluent-kafka alone, never against the sidecar's internals: it is what an application imports, so it
must keep working with any sidecar that honours the contract, and it must not drag the sidecar's
dependencies into the application. That is why the header names are declared again here.
"""

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

__all__ = [
    "CONTROL_TOPIC",
    "DELIVER_AFTER_HEADER",
    "DELIVER_AT_HEADER",
    "EFFECTIVE_DELIVER_AT_HEADER",
    "ORIGIN_HEADER",
    "ORIGIN_OFFSET_HEADER",
    "ORIGIN_PARTITION_HEADER",
    "ORIGIN_TOPIC_HEADER",
    "REDELIVERY_COUNT_HEADER",
    "CommandWriter",
    "MessageId",
    "NackDeliveryError",
    "Nacker",
    "backoff_delay",
    "delay_headers",
    "deliver_at",
    "origin",
    "outbound_consumer_config",
    "redelivery_count",
]

# Contract section 1: what a producer puts on an inbound record.
DELIVER_AT_HEADER = "deliver-at"
DELIVER_AFTER_HEADER = "deliver-after"

# Contract section 4: what the sidecar puts on every delivery. The compact form (the default) is
# ORIGIN_HEADER ("topic/partition/offset") and the deliver-at, with the count only above 0; the v1 form
# (--outbound-headers v1) is the three ORIGIN_*_HEADER and the count always. Both are read here.
ORIGIN_HEADER = "delay-origin"
ORIGIN_TOPIC_HEADER = "delay-origin-topic"
ORIGIN_PARTITION_HEADER = "delay-origin-partition"
ORIGIN_OFFSET_HEADER = "delay-origin-offset"
EFFECTIVE_DELIVER_AT_HEADER = "delay-deliver-at"
REDELIVERY_COUNT_HEADER = "delay-redelivery-count"

# Contract section 5.
CONTROL_TOPIC = "delay-sidecar.control"
COMMAND_VERSION = 1

_DURATION = re.compile(r"[0-9]+(?:ms|s|m|h|d)?")
_DECIMAL = re.compile(r"[0-9]+")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)


def outbound_consumer_config(bootstrap_servers: str, group_id: str, **overrides: Any) -> dict[str, Any]:
    """Settings of a consumer of an outbound topic, for confluent_kafka.Consumer.

    `isolation.level` is read_committed: in exactly-once mode the sidecar writes in transactions,
    and a read_uncommitted consumer would also see the records of transactions it aborted (after a
    crash or when fenced), as duplicates. Overrides win, so a caller can still choose otherwise.
    """
    return {
        "bootstrap.servers": bootstrap_servers,
        "group.id": group_id,
        "isolation.level": "read_committed",
        **overrides,
    }


HeaderValue = str | bytes | None
# Both shapes confluent-kafka's own type stubs allow, so a typed `confluent_kafka.Message` fits `Record`.
HeadersLike = Sequence[tuple[str, HeaderValue]] | Mapping[str, HeaderValue] | None
DeliveryCallback = Callable[[Any, Any], None]


class Record(Protocol):
    """The part of a consumed `confluent_kafka.Message` these helpers read: only its headers."""

    def headers(self) -> HeadersLike: ...


class NackProducer(Protocol):
    """The part of `confluent_kafka.Producer` a Nacker uses; a fake or a wrapper fits as well."""

    def produce(
        self, topic: str, value: bytes | None = None, key: bytes | None = None, *, on_delivery: Any = None
    ) -> None: ...

    def flush(self, timeout: float = -1) -> int: ...


# ---------------------------------------------------------------------------------------------------
# Producers (contract section 1)


def delay_headers(
    *,
    deliver_at: int | datetime | None = None,
    deliver_after: int | timedelta | str | None = None,
) -> list[tuple[str, bytes]]:
    """Headers asking the sidecar to hold an inbound record; pass them as `produce(..., headers=...)`.

    The sidecar sends a record with a malformed header to the dead-letter topic, where the producer
    never hears of it, so every value is checked here, at the call that can still fix it.

    `deliver_at` is an instant: epoch milliseconds, or a timezone-aware datetime (a naive one would
    be read in whatever zone the process happens to run in). `deliver_after` counts from the record's
    Kafka timestamp, not from when the sidecar sees it: milliseconds, a timedelta (truncated to whole
    milliseconds), or one of the contract's duration strings (`1500`, `250ms`, `30s`, `5m`, `2h`,
    `7d`), sent as written so that a person reading the topic sees what was asked for.
    """
    if (deliver_at is None) == (deliver_after is None):
        raise TypeError("delay_headers() takes exactly one of deliver_at= or deliver_after=")
    if deliver_at is not None:
        return [(DELIVER_AT_HEADER, str(_epoch_ms(deliver_at, DELIVER_AT_HEADER)).encode("ascii"))]
    if isinstance(deliver_after, str):
        if deliver_after.startswith("-"):
            raise ValueError(f"deliver_after={deliver_after!r} is negative; a delay must be zero or more")
        if not _DURATION.fullmatch(deliver_after):
            raise ValueError(
                f"deliver_after={deliver_after!r} is not a duration the sidecar accepts; "
                "use milliseconds (1500) or 250ms, 30s, 5m, 2h, 7d"
            )
        return [(DELIVER_AFTER_HEADER, deliver_after.encode("ascii"))]
    assert deliver_after is not None
    return [(DELIVER_AFTER_HEADER, str(_duration_ms(deliver_after, DELIVER_AFTER_HEADER)).encode("ascii"))]


def _epoch_ms(value: int | datetime, what: str) -> int:
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"{what}={value!r} has no timezone; use an aware datetime such as datetime.now(UTC)")
        # Integer arithmetic on timedeltas: float timestamps lose the last millisecond on some instants.
        ms = (value - _EPOCH) // _ONE_MS
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    else:
        raise TypeError(f"{what} must be epoch milliseconds (int) or an aware datetime, not {type(value).__name__}")
    if ms < 0:
        raise ValueError(f"{what}={value!r} is before 1970; an instant must be zero or more epoch milliseconds")
    return ms


def _duration_ms(value: int | timedelta, what: str) -> int:
    if isinstance(value, timedelta):
        ms = value // _ONE_MS
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    else:
        raise TypeError(f"{what} must be milliseconds (int) or a timedelta, not {type(value).__name__}")
    if ms < 0:
        raise ValueError(f"{what}={value!r} is negative; a delay must be zero or more")
    return ms


# ---------------------------------------------------------------------------------------------------
# Consumers: reading outbound records (contract section 4)


@dataclass(frozen=True, slots=True)
class MessageId:
    """Where the sidecar read a message: the identity a nack names.

    The outbound record's own topic and offset are not it: every redelivery is a new outbound record,
    while the origin stays the same for the message's whole life.
    """

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"


def origin(message: Record) -> MessageId:
    """The message id of an outbound record, to nack it or to recognise a redelivery of it."""
    compact, ours = _ours(message)
    if compact:
        text = _text(ours, ORIGIN_HEADER)
        parts = text.rsplit("/", 2)
        if len(parts) != 3 or not parts[0] or not all(_DECIMAL.fullmatch(p) for p in parts[1:]):
            raise ValueError(f"header '{ORIGIN_HEADER}' is {text!r}, not topic/partition/offset")
        return MessageId(parts[0], int(parts[1]), int(parts[2]))
    topic = _text(ours, ORIGIN_TOPIC_HEADER)
    if not topic:
        raise ValueError(f"header '{ORIGIN_TOPIC_HEADER}' is empty")
    return MessageId(
        topic=topic,
        partition=_int(ours, ORIGIN_PARTITION_HEADER),
        offset=_int(ours, ORIGIN_OFFSET_HEADER),
    )


def redelivery_count(message: Record) -> int:
    """How many times this message was nacked before: 0 on first delivery, the input of a backoff."""
    compact, ours = _ours(message)
    if compact and not any(key == REDELIVERY_COUNT_HEADER for key, _ in ours):
        return 0  # the compact form writes the count only above 0
    return _int(ours, REDELIVERY_COUNT_HEADER)


def deliver_at(message: Record) -> int:
    """The effective deliver-at in epoch ms, after the sidecar's policies: what lateness is measured from."""
    return _int(_ours(message)[1], EFFECTIVE_DELIVER_AT_HEADER)


Pairs = list[tuple[str, HeaderValue]]


def _ours(message: Record) -> tuple[bool, Pairs]:
    """(compact form?, the headers the sidecar wrote): those from its last origin header on.

    The sidecar appends its headers after the record's original ones, so when a record that already
    went through a sidecar is delayed again, the first sidecar's headers come before ours."""
    headers = message.headers()
    pairs: Pairs = list(headers.items() if isinstance(headers, Mapping) else (headers or ()))
    start, compact = -1, False
    for i, (key, _) in enumerate(pairs):
        if key in (ORIGIN_HEADER, ORIGIN_TOPIC_HEADER):
            start, compact = i, key == ORIGIN_HEADER
    if start < 0:
        raise ValueError(
            f"record has no '{ORIGIN_HEADER}' header (nor the v1 form's '{ORIGIN_TOPIC_HEADER}'): it was not "
            "delivered by the delay sidecar (read the subscription's outbound topic, not the inbound one)"
        )
    return compact, pairs[start:]


def _text(pairs: Pairs, name: str) -> str:
    found: HeaderValue = None
    present = False
    for key, value in pairs:
        if key == name:
            found, present = value, True
    if not present:
        raise ValueError(f"record has no '{name}' header: the sidecar writes it on every delivery")
    if found is None:
        raise ValueError(f"header '{name}' has no value")
    if isinstance(found, bytes):
        try:
            return found.decode("ascii")
        except UnicodeDecodeError:
            raise ValueError(f"header '{name}' is not ASCII text: {found!r}") from None
    return found


def _int(pairs: Pairs, name: str) -> int:
    text = _text(pairs, name)
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"header '{name}' is {text!r}, not a non-negative decimal integer")
    return int(text)


# ---------------------------------------------------------------------------------------------------
# Consumers: delayed nack through the control topic (contract section 5)


class NackDeliveryError(RuntimeError):
    """A nack command the producer could not write; the message will not come back on its own.

    The consumer must not commit past the nacked record then, or the message is lost to it.
    """

    def __init__(self, errors: list[str]) -> None:
        super().__init__(f"{len(errors)} nack command(s) not written to the control topic: {'; '.join(errors)}")
        self.errors = errors


class CommandWriter:
    """Writes commands to the control topic, and turns a failed write into an exception at `flush()`.

    librdkafka reports a failed write only to a delivery callback; a caller that commits or moves on
    after `flush()` returned must know by then that every command was written.
    """

    def __init__(self, producer: NackProducer, control_topic: str = CONTROL_TOPIC) -> None:
        if not control_topic:
            raise ValueError("control_topic must not be empty")
        self._producer = producer
        self.control_topic = control_topic
        self._failures: list[str] = []

    def flush(self, timeout: float = -1) -> int:
        """Wait for the commands sent so far; the count still queued is returned, as the producer does.

        Raises NackDeliveryError when any command failed since the last flush, because a failed write
        does not raise anywhere else and the consumer would otherwise commit a message it has lost.
        """
        remaining = self._producer.flush(timeout)
        if self._failures:
            failures, self._failures = self._failures, []
            raise NackDeliveryError(failures)
        return remaining


class Nacker(CommandWriter):
    """Asks the sidecar to redeliver a message later, Pulsar's `negativeAcknowledge(message, delay)`.

    This is the retry recipe without a retry topic: the command names the message by its origin, and
    the sidecar re-sends the stored original to the subscription's outbound topic, so the payload is
    neither produced again nor read from a second topic.

    A command is keyed by the message id (`topic/partition/offset`), so every command about one message
    lands on one control partition in order and "the latest command wins" means the latest one sent.

    Commit the nacked record's offset only after `flush()` returned: librdkafka reports a failed write
    only to a delivery callback, and `flush()` is where this class turns that report into an exception.
    Not thread-safe: use one Nacker per consumer thread (the producer itself may be shared).
    """

    def __init__(
        self, producer: NackProducer, control_topic: str = CONTROL_TOPIC, subscription: str | None = None
    ) -> None:
        super().__init__(producer, control_topic)
        if subscription is not None and not subscription:
            raise ValueError("subscription must not be empty; pass None to name it on each nack")
        self.subscription = subscription

    def nack(
        self,
        message: Record,
        delay: int | timedelta,
        *,
        subscription: str | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        """Redeliver `message` to this subscription once `delay` (ms or timedelta) has passed.

        The delay counts from the command record's Kafka timestamp, as the sidecar reads it: a
        producer with `log.message.timestamp.type=LogAppendTime` topics or a skewed clock shifts it;
        use `nack_at` when the instant matters more than the interval.
        """
        self._send(message, "delay_ms", _duration_ms(delay, "delay"), subscription, on_delivery)

    def nack_at(
        self,
        message: Record,
        deliver_at_ms: int | datetime,
        *,
        subscription: str | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        """Redeliver `message` to this subscription at an instant (epoch ms or an aware datetime).

        An instant now or in the past redelivers at once, as a deliver-at header would.
        """
        self._send(message, "deliver_at", _epoch_ms(deliver_at_ms, "deliver_at_ms"), subscription, on_delivery)

    def _send(
        self,
        message: Record,
        when_field: str,
        when: int,
        subscription: str | None,
        on_delivery: DeliveryCallback | None,
    ) -> None:
        subscription = subscription or self.subscription
        if not subscription:
            # An outbound topic is `{topic}.{subscription}` only by default (it can be renamed per
            # subscription), so guessing the subscription from the record's topic could nack the wrong one.
            raise ValueError("no subscription: pass subscription= to nack() or to Nacker()")
        message_id = origin(message)
        command: dict[str, object] = {
            "v": COMMAND_VERSION,
            "type": "nack",
            "subscription": subscription,
            "topic": message_id.topic,
            "partition": message_id.partition,
            "offset": message_id.offset,
            when_field: when,
            # Optional field: the count the nacked delivery carried, so the sidecar can number the
            # redelivery (count + 1) without keeping a counter per message and subscription itself.
            "redelivery_count": redelivery_count(message),
        }
        value = json.dumps(command, separators=(",", ":")).encode()

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                self._failures.append(f"{message_id} for {subscription!r}: {err}")
            if on_delivery is not None:
                on_delivery(err, msg)

        self._producer.produce(self.control_topic, value=value, key=str(message_id).encode(), on_delivery=delivered)


# ---------------------------------------------------------------------------------------------------
# Backoff


def backoff_delay(redelivery_count: int, base_ms: int = 1_000, factor: float = 2.0, max_ms: int = 600_000) -> int:
    """Delay in ms before the next attempt: `base_ms * factor ** redelivery_count`, capped at `max_ms`.

    Growing delays give a struggling dependency room to recover instead of hammering it; the cap (ten
    minutes by default) keeps a message that keeps failing coming back often enough to be noticed.
    """
    if redelivery_count < 0:
        raise ValueError(f"redelivery_count={redelivery_count} is negative")
    if base_ms < 0 or max_ms < 0:
        raise ValueError(f"base_ms={base_ms} and max_ms={max_ms} must be zero or more")
    if factor < 1:
        raise ValueError(f"factor={factor} would shrink the delay; use 1 or more")
    try:
        delay = base_ms * factor**redelivery_count
    except OverflowError:
        return max_ms
    return int(min(delay, max_ms))
