"""Cancel and reschedule commands: the JSON a sender writes, the records the sidecar writes for them.

Pure code. A command travels in three steps, each a Kafka record:

1. The *command*, on the control topic, keyed by the message id like a nack. The control
   partition's owner checks it (shape, topic, subscription, policies) and answers the ones it can
   refuse on its own with an outcome.
2. A *request*, which that owner appends to the inbound partition of the message. The inbound
   partition's owner is the one place that delivers the message, so it is the one place that can
   decide "cancelled" or "too late" without a race: it reads the request in log order, between
   deliveries (RocketMQ's timer log keeps its deletes in the log the same way). A reschedule's
   request is itself the new entry of the index: an offset of the partition at the new time, whose
   payload the dispatcher reads from the original message.
3. A *fact*, which the inbound owner appends to the same partition when a request changed
   something, and the *outcome* on `<control>.outcomes`. Facts, not requests, are what a rebuild of
   the partition reads again: the decision is never taken twice.

Every record the sidecar writes to an inbound partition starts with the header `delay-command-by`
naming its consumer group, so other groups, the audit and the intake skip it.
"""

import base64
import binascii
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from sidecar.control.fields import (
    INVALID_COMMAND,  # noqa: F401 - an outcome code too, listed with the others
    count,
    invalid,
    text,
    when,
)

VERSION = 1
Kind = Literal["cancel", "reschedule"]
KINDS: tuple[Kind, ...] = ("cancel", "reschedule")

COMMAND_BY = "delay-command-by"
"""First header of every record the sidecar appends to an inbound partition: its consumer group."""
REQUEST = "delay-command"
"""Second header of a request: the command as the inbound owner needs it (JSON)."""
FACT = "delay-command-fact"
"""Second header of a fact: what a request changed (JSON)."""

OUTCOMES_SUFFIX = ".outcomes"


def is_marked(headers: list[tuple[str, bytes | None]] | None) -> bool:
    """A record a sidecar (of any group) wrote to an inbound partition: never a message to deliver."""
    return bool(headers) and headers[0][0] == COMMAND_BY  # type: ignore[index]


# Outcomes
CANCELLED = "cancelled"
RESCHEDULED = "rescheduled"
TOO_LATE = "too-late"
UNKNOWN_MESSAGE_OUTCOME = "unknown-message"
REJECTED = "rejected"

# Codes of `rejected` outcomes (and of commands too malformed to have one: the control dead-letter topic)
UNKNOWN_TOPIC = "UNKNOWN_TOPIC"
UNKNOWN_SUBSCRIPTION = "UNKNOWN_SUBSCRIPTION"
EXCEEDS_MAX_DELAY = "EXCEEDS_MAX_DELAY"
FIXED_DELAY_TOPIC = "FIXED_DELAY_TOPIC"
DELAYS_DISABLED = "DELAYS_DISABLED"
NOT_DELAYED = "NOT_DELAYED"
DEAD_LETTERED = "DEAD_LETTERED"
ALREADY_CANCELLED = "ALREADY_CANCELLED"
NOT_KEYED = "NOT_KEYED"
"""A command by key for a topic whose records are not kept by key (`by_key: replace`)."""
WRONG_CONTROL_TOPIC = "WRONG_CONTROL_TOPIC"
"""Nacks too: the topic has a control topic of its own and the command came on another (topics.py)."""

_MAX_TOPIC_LENGTH = 249
_MAX_ID_LENGTH = 256
MAX_KEY_BYTES = 4096
"""Longest key a command may name a message by: its request carries it to the inbound partition."""


@dataclass(frozen=True)
class CommandRef:
    """The fields an answer repeats from its command, as far as they could be read."""

    kind: Kind | None
    topic: str | None
    partition: int | None
    offset: int | None
    id: str | None
    key: bytes | None = None


@dataclass(frozen=True)
class MessageCommand:
    """A cancel or reschedule of one message: (topic, partition, offset), or, on a keyed topic, the
    key's pending record (`key`; partition and offset are then -1 until its partition's owner
    finds it)."""

    kind: Kind
    topic: str
    partition: int
    offset: int
    subscription: str | None = None
    """One subscription; None: every subscription the message is owed to."""
    id: str | None = None
    """Chosen by the sender and copied into the outcome, to match the two."""
    deliver_at: int | None = None
    delay_ms: int | None = None
    key: bytes | None = None

    @property
    def ref(self) -> CommandRef:
        if self.key is not None:
            return CommandRef(self.kind, self.topic, None, None, self.id, self.key)
        return CommandRef(self.kind, self.topic, self.partition, self.offset, self.id)

    def named(self, subscriptions: Iterable[str]) -> list[str]:
        """The subscriptions it is for: the one it names, else all of the topic's `subscriptions`."""
        return [self.subscription] if self.subscription else list(subscriptions)

    def new_deliver_at(self, sent_ms: int) -> int:
        """A reschedule's deliver-at: as sent, or the command's timestamp plus delay_ms."""
        return self.deliver_at if self.deliver_at is not None else sent_ms + (self.delay_ms or 0)


def parse_message_command(data: dict[str, Any]) -> MessageCommand:
    """A decoded JSON object whose type is cancel or reschedule; RejectedRecord(INVALID_COMMAND) when malformed."""
    kind = data.get("type")
    if kind not in KINDS:
        raise invalid(f"unknown command type {kind!r}; the types are 'nack', 'cancel' and 'reschedule'")
    topic = text(data, "topic")
    if len(topic) > _MAX_TOPIC_LENGTH:
        raise invalid("'topic' is longer than any Kafka topic name")
    key = message_key(data)
    if key is None:
        partition, offset = count(data, "partition"), count(data, "offset")
    elif "partition" in data or "offset" in data:
        raise invalid("name the message by 'key' or by 'partition' and 'offset', not both")
    else:
        partition = offset = -1
    subscription = text(data, "subscription") if "subscription" in data else None
    command_id = text(data, "id") if "id" in data else None
    if command_id is not None and len(command_id) > _MAX_ID_LENGTH:
        raise invalid(f"'id' is longer than {_MAX_ID_LENGTH} characters")
    deliver_at = delay_ms = None
    if kind == "reschedule":
        delay_ms, deliver_at = when(data)
    elif "delay_ms" in data or "deliver_at" in data:
        raise invalid("a cancel takes no 'delay_ms' or 'deliver_at'; send a reschedule to move a message")
    return MessageCommand(kind, topic, partition, offset, subscription, command_id, deliver_at, delay_ms, key)


def message_key(data: dict[str, Any]) -> bytes | None:
    """The key a command names its message by: `key` (UTF-8 text) or `key_base64`; None for neither."""
    if "key" in data and "key_base64" in data:
        raise invalid("give 'key' or 'key_base64', not both")
    if "key" in data:
        key = text(data, "key").encode()
    elif "key_base64" in data:
        try:
            key = base64.b64decode(text(data, "key_base64"), validate=True)
        except ValueError:  # binascii.Error, or a character outside ASCII
            raise invalid("'key_base64' is not base64 (RFC 4648, with padding)") from None
        if not key:
            raise invalid("'key_base64' must name a non-empty key")
    else:
        return None
    if len(key) > MAX_KEY_BYTES:
        raise invalid(f"the key is longer than {MAX_KEY_BYTES} bytes")
    return key


def key_fields(key: bytes) -> dict[str, str]:
    """A key as the JSON of outcomes and requests carries it: `key` when it is UTF-8, else `key_base64`."""
    try:
        return {"key": key.decode()}
    except UnicodeDecodeError:
        return {"key_base64": base64.b64encode(key).decode()}


def message_kind(raw: bytes | None) -> Kind | None:
    """'cancel' or 'reschedule' when a control record says it is one, however malformed otherwise."""
    kind = _load(raw).get("type")
    return kind if kind in KINDS else None


def loose_command(raw: bytes | None) -> CommandRef:
    """What can be read of a malformed cancel or reschedule, for its answer: fields of the wrong type are left out."""
    data = _load(raw)
    kind, topic, partition, offset, command_id = (data.get(k) for k in ("type", "topic", "partition", "offset", "id"))
    return CommandRef(
        kind if kind in KINDS else None,
        topic if isinstance(topic, str) else None,
        partition if isinstance(partition, int) and not isinstance(partition, bool) else None,
        offset if isinstance(offset, int) and not isinstance(offset, bool) else None,
        command_id[:_MAX_ID_LENGTH] if isinstance(command_id, str) else None,
    )


# ------------------------------------------------------------------------------ request


@dataclass(frozen=True)
class Request:
    """What the inbound owner reads: the command, checked, with the new deliver-at worked out."""

    kind: Kind
    offset: int
    subscription: str | None
    id: str | None
    deliver_at: int | None
    """Reschedules: the new deliver-at, from the command's timestamp."""
    source: tuple[str, int, int]
    """(control topic, partition, offset) of the command: its answer goes to that control topic's outcomes."""
    key: bytes | None
    """The command's key, which its outcome carries too."""
    nacks: tuple[str, ...] = ()
    """The subscriptions whose pending nack redelivery the control partition's owner cancelled or
    moved (they count as cancelled or rescheduled in the outcome, whatever the first delivery did)."""
    by_key: bytes | None = None
    """A command by key: the message is the key's pending record in this partition (`offset` is -1
    until its owner finds it)."""
    relay: int | None = None
    """A command by key: the partition to ask next when this one holds no pending record of the key
    (librdkafka's and Java's default partitioners place a key differently: key_partitions.py)."""

    def encode(self) -> bytes:
        data: dict[str, Any] = {
            "kind": self.kind,
            "offset": self.offset,
            "subscription": self.subscription,
            "id": self.id,
            "deliver_at": self.deliver_at,
            "source": list(self.source),
            "key": self.key.decode("latin-1") if self.key is not None else None,
        }
        if self.nacks:  # rare: only a cancel or reschedule of a nacked message
            data["nacks"] = list(self.nacks)
        if self.by_key is not None:
            data["by_key"] = base64.b64encode(self.by_key).decode()
            data["relay"] = self.relay
        return _dump(data)

    @classmethod
    def decode(cls, raw: bytes | None, default_control: str) -> "Request | None":
        """`default_control`: the control topic of a request written before requests named theirs."""
        data = _load(raw)
        try:
            kind = data["kind"]
            source = data["source"]
            key = data["key"]
            control = str(source[0]) if len(source) == 3 else default_control
            request = cls(
                kind,
                int(data["offset"]),
                data["subscription"],
                data["id"],
                data["deliver_at"],
                (control, int(source[-2]), int(source[-1])),
                key.encode("latin-1") if isinstance(key, str) else None,
                tuple(str(s) for s in data.get("nacks") or ()),
                base64.b64decode(data["by_key"]) if "by_key" in data else None,
                None if data.get("relay") is None else int(data["relay"]),
            )
        except (KeyError, TypeError, ValueError, IndexError, binascii.Error):
            return None
        return request if kind in KINDS else None


# ------------------------------------------------------------------------------ fact


@dataclass(frozen=True)
class Fact:
    """What one request changed, written after it was decided: the record a rebuild reads again.

    `suppress`: (carrier offset, subscription) pairs that must not be delivered any more. A
    carrier is the original record, or the copy an earlier reschedule made (its request's offset).
    With `deliver_at` set (a reschedule), the request itself is the new copy: it delivers the
    message to `subs` at `deliver_at`, with the original's message id.
    """

    origin: int
    request: int
    suppress: tuple[tuple[int, str], ...]
    deliver_at: int | None = None
    subs: tuple[str, ...] = ()
    key: bytes | None = None
    """A reschedule on a keyed topic: the message's key, whose pending record it moved (the key
    index takes the new time when the fact is read, live and in a rebuild alike)."""

    @property
    def copy(self) -> int | None:
        """The offset of the copy a reschedule made (its request), or None for a cancel."""
        return self.request if self.deliver_at is not None else None

    def encode(self) -> bytes:
        return _dump(
            {
                "origin": self.origin,
                "request": self.request,
                "suppress": [list(p) for p in self.suppress],
                "deliver_at": self.deliver_at,
                "subs": list(self.subs),
                **({"key_base64": base64.b64encode(self.key).decode()} if self.key is not None else {}),
            }
        )

    @classmethod
    def decode(cls, raw: bytes | None) -> "Fact | None":
        data = _load(raw)
        try:
            return cls(
                int(data["origin"]),
                int(data["request"]),
                tuple((int(c), str(s)) for c, s in data["suppress"]),
                None if data["deliver_at"] is None else int(data["deliver_at"]),
                tuple(str(s) for s in data["subs"]),
                base64.b64decode(data["key_base64"]) if "key_base64" in data else None,
            )
        except (KeyError, TypeError, ValueError, binascii.Error):
            return None


# ------------------------------------------------------------------------------ outcome


Outcome = Literal["cancelled", "rescheduled", "too-late", "unknown-message", "rejected"]


@dataclass(frozen=True)
class OutcomeRecord:
    """The one answer to a cancel or reschedule, on `<control topic>.outcomes`, keyed like the command."""

    outcome: Outcome
    kind: Kind | None
    topic: str | None
    partition: int | None
    offset: int | None
    id: str | None
    source: tuple[str, int, int]
    """(control topic, partition, offset) of the command."""
    subscriptions: tuple[str, ...] = ()
    """cancelled / rescheduled: the subscriptions it applied to."""
    too_late: tuple[str, ...] = ()
    """Subscriptions it came too late for, when it applied to others."""
    deliver_at: int | None = None
    """rescheduled: the new deliver-at."""
    delivered_at: int | None = None
    """too-late: the deliver-at the message went out at (or was due at), when known."""
    code: str | None = None
    message: str | None = None
    nacks: tuple[str, ...] = ()
    """cancelled / rescheduled: the subscriptions whose pending nack redelivery it took back or
    moved (their first delivery had gone out already)."""
    message_key: bytes | None = None
    """A command by key: the key it named (partition and offset say the record it found, if any)."""

    def encode(self) -> bytes:
        data: dict[str, Any] = {
            "v": VERSION,
            "outcome": self.outcome,
            "type": self.kind,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "id": self.id,
            "command": {"topic": self.source[0], "partition": self.source[1], "offset": self.source[2]},
        }
        if self.message_key is not None:
            data.update(key_fields(self.message_key))
        optional: dict[str, Any] = {
            "subscriptions": list(self.subscriptions) or None,
            "too_late": list(self.too_late) or None,
            "deliver_at": self.deliver_at,
            "delivered_at": self.delivered_at,
            "code": self.code,
            "message": self.message,
            "nacks": list(self.nacks) or None,
        }
        data.update({k: v for k, v in optional.items() if v is not None})
        return _dump(data)


def _dump(data: dict[str, Any]) -> bytes:
    """JSON, compact. msgspec rather than json: a burst of cancels encodes three documents per
    command (request, fact, outcome), and json.dumps was a tenth of the loop."""
    return _encode(data)


def _load(raw: bytes | None) -> dict[str, Any]:
    try:
        data = _decode(raw or b"")
    except (ValueError, UnicodeDecodeError):  # (msgspec.DecodeError is a ValueError)
        return {}
    return data if isinstance(data, dict) else {}


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
