"""Nack commands from the control topic: versioned JSON in, a typed command or a coded rejection out.

Pure code. It checks the command's shape and its delay against the topic's max delay; whether the
subscription and the message exist is for the caller, who knows the policies and the log.
"""

import json
import re
from collections.abc import Iterable
from typing import Annotated, Literal, NamedTuple

import msgspec

from sidecar.control.cancels import KINDS, MessageCommand, parse_message_command
from sidecar.control.fields import count, invalid, text, when
from sidecar.durations import MAX_EPOCH_MS, format_duration_ms
from sidecar.errors import RejectedRecord
from sidecar.policy.model import EffectiveDelay

VERSION = 1
UNKNOWN_SUBSCRIPTION = "UNKNOWN_SUBSCRIPTION"
UNKNOWN_MESSAGE = "UNKNOWN_MESSAGE"
EXCEEDS_MAX_DELAY = "EXCEEDS_MAX_DELAY"
# Kafka's own limit on a topic name; anything longer cannot be a topic the sidecar serves.
_MAX_TOPIC_LENGTH = 249


class NackCommand(NamedTuple):
    """A tuple, not a dataclass: a burst builds one per command, and a frozen dataclass's
    constructor was a tenth of the loop."""

    subscription: str
    topic: str
    partition: int
    offset: int
    delay_ms: int | None
    deliver_at: int | None
    redelivery_count: int
    """delay-redelivery-count of the record the consumer nacked; the redelivery carries this + 1."""

    @property
    def message_key(self) -> tuple[str, str, int, int]:
        """What "the same subscription and message" means for latest-wins."""
        return (self.subscription, self.topic, self.partition, self.offset)

    def effective_deliver_at(self, received_ms: int) -> int:
        """deliver_at as sent, or the time the sidecar read the command plus delay_ms."""
        return self.deliver_at if self.deliver_at is not None else received_ms + (self.delay_ms or 0)


class _NackWire(msgspec.Struct):
    """A well-formed nack command, decoded and checked in one pass in C (msgspec): a burst of nacks
    spent a fifth of its loop in json.loads and the field checks. Anything it does not take as is
    goes the long way, `_parse`, which alone says what is wrong, so both always agree."""

    v: Literal[1]
    type: Literal["nack"]
    subscription: Annotated[str, msgspec.Meta(min_length=1)]
    topic: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_TOPIC_LENGTH)]
    partition: Annotated[int, msgspec.Meta(ge=0)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    redelivery_count: Annotated[int, msgspec.Meta(ge=0)] = 0
    delay_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH_MS)] | msgspec.UnsetType = msgspec.UNSET
    deliver_at: Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH_MS)] | msgspec.UnsetType = msgspec.UNSET


_decode_nack = msgspec.json.Decoder(_NackWire).decode


def parse_command(raw: bytes | None) -> NackCommand | MessageCommand:
    """Decode one control record's value; raises RejectedRecord(INVALID_COMMAND) for any malformed one."""
    if raw is not None:
        try:
            wire = _decode_nack(raw)
        except msgspec.DecodeError:
            pass  # not a well-formed nack: _parse says why, or reads a cancel or reschedule
        else:
            delay_ms, deliver_at = wire.delay_ms, wire.deliver_at
            if isinstance(delay_ms, int) != isinstance(deliver_at, int):  # exactly one of them
                return NackCommand(
                    wire.subscription,
                    wire.topic,
                    wire.partition,
                    wire.offset,
                    delay_ms if isinstance(delay_ms, int) else None,
                    deliver_at if isinstance(deliver_at, int) else None,
                    wire.redelivery_count,
                )
    return _parse(raw)


def _parse(raw: bytes | None) -> NackCommand | MessageCommand:
    if raw is None:
        raise invalid("the control record has no value; send a JSON nack command")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f'not JSON ({e}); send {{"v": 1, "type": "nack", ...}}') from None
    if not isinstance(data, dict):
        raise invalid("expected a JSON object")
    if data.get("v") != VERSION:
        raise invalid(f"unsupported version v={data.get('v')!r}; this sidecar reads v=1")
    if data.get("type") == ACCEPTED:
        raise invalid("records of type 'accepted' are written by the sidecar itself; send 'nack' commands")
    if data.get("type") in KINDS:
        return parse_message_command(data)
    if data.get("type") != "nack":
        raise invalid(f"unknown command type {data.get('type')!r}; the types are 'nack', 'cancel' and 'reschedule'")
    subscription = text(data, "subscription")
    topic = text(data, "topic")
    if len(topic) > _MAX_TOPIC_LENGTH:
        raise invalid("'topic' is longer than any Kafka topic name")
    partition = count(data, "partition")
    offset = count(data, "offset")
    redelivery_count = count(data, "redelivery_count") if "redelivery_count" in data else 0
    delay_ms, deliver_at = when(data)
    return NackCommand(subscription, topic, partition, offset, delay_ms, deliver_at, redelivery_count)


def check_max_delay(command: NackCommand, delay: EffectiveDelay, received_ms: int) -> None:
    """The topic's max delivery delay applies to nack delays as to producers' (contract section 5)."""
    if not delay.is_enabled or delay.max_ms <= 0:
        return
    asked = command.effective_deliver_at(received_ms) - received_ms
    if asked > delay.max_ms:
        raise RejectedRecord(
            EXCEEDS_MAX_DELAY,
            f"nack delay of {format_duration_ms(asked)} exceeds the max delivery delay "
            f"{format_duration_ms(delay.max_ms)} (from {delay.max_delivery_delay.source}) "
            f"by {format_duration_ms(asked - delay.max_ms)}",
        )


ACCEPTED = "accepted"
ACCEPTED_BY = "delay-accepted-by"
"""Header of accepted records: the consumer group of the sidecar that wrote it."""


ControlPosition = tuple[str, int, int]
"""(control topic, partition, offset) of a command."""


class AcceptedNack(NamedTuple):
    """The sidecar's durable record that it accepted a nack, written to the command's control partition.

    The control log holds it until the redelivery is done, so an accepted nack survives any loss of
    local state, and the command itself is never judged twice. A tuple, like NackCommand.
    """

    command: NackCommand
    deliver_at: int
    source: ControlPosition
    """Where the command is: identifies the acceptance for latest-wins."""
    cancelled: bool = False
    """Written for a cancel: it supersedes the pending nack like a later nack, and redelivers nothing."""

    def encode(self) -> bytes:
        """The accepted record's value (JSON)."""
        # A template rather than json.dumps of a dict: a burst of nacks encodes one per command,
        # and that was a tenth of the loop. Only the two names need escaping.
        c = self.command
        names = _quoted_names(c.subscription, c.topic)
        cancelled = ',"cancelled":true' if self.cancelled else ""
        return (
            f'{{"v":{VERSION},"type":"{ACCEPTED}",{names},"partition":{c.partition},"offset":{c.offset},'
            f'"deliver_at":{self.deliver_at},"redelivery_count":{c.redelivery_count},'
            f'"command_partition":{self.source[1]},"command_offset":{self.source[2]}{cancelled}}}'
        ).encode()


def cancelled_acceptances(
    command: MessageCommand, subscriptions: Iterable[str], at: int, source: ControlPosition
) -> list[AcceptedNack]:
    """What a cancel at `source` writes (and its index entry stands for) to take back the message's
    pending nacks: one cancelled acceptance per subscription, in force from `at`."""
    message = (command.topic, command.partition, command.offset)
    return [AcceptedNack(NackCommand(sub, *message, None, at, 0), at, source, True) for sub in subscriptions]


def moved_acceptances(
    command: MessageCommand, pending: dict[str, tuple[int, int]], at: int, source: ControlPosition
) -> list[AcceptedNack]:
    """What a reschedule at `source` writes to move the message's pending nacks to `at`: one
    acceptance per subscription (`pending`: sub -> (deliver-at, redelivery count it will carry)),
    carrying the redelivery count of the nack it supersedes."""
    message = (command.topic, command.partition, command.offset)
    return [
        AcceptedNack(NackCommand(sub, *message, None, at, carries - 1), at, source)
        for sub, (_, carries) in pending.items()
    ]


_QUOTED: dict[tuple[str, str], str] = {}
_MAX_QUOTED = 10_000


def _quoted_names(subscription: str, topic: str) -> str:
    """`"subscription":...,"topic":...` as JSON, remembered: a burst names few of them."""
    found = _QUOTED.get((subscription, topic))
    if found is None:
        if len(_QUOTED) >= _MAX_QUOTED:
            _QUOTED.clear()
        found = _QUOTED[(subscription, topic)] = (
            f'"subscription":{json.dumps(subscription)},"topic":{json.dumps(topic)}'
        )
    return found


_COMMAND_OFFSET = re.compile(rb'"command_offset":(\d+)')


def accepted_key(raw: bytes | None) -> int | None:
    """The command offset of an accepted record's first line, without decoding the rest: the member
    that wrote it skips it by that alone when it comes back (None: not found, decode it)."""
    found = _COMMAND_OFFSET.search(raw or b"")
    return int(found[1]) if found is not None else None


def parse_accepted_record(raw: bytes | None, control_topic: str) -> list[AcceptedNack] | None:
    """The acceptances an accepted record holds: one JSON object per line, in command order (a slice
    of commands writes one record per control partition). None unless every line is one."""
    found = []
    for line in (raw or b"").split(b"\n"):
        accepted = parse_accepted(line, control_topic)
        if accepted is None:
            return None
        found.append(accepted)
    return found


def parse_accepted(raw: bytes | None, control_topic: str) -> AcceptedNack | None:
    """An accepted record's content; None when the value is not one (a command, or garbage).

    The record lies in its command's control partition, so only the partition and offset are in it."""
    try:
        data = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("type") != ACCEPTED or data.get("v") != VERSION:
        return None
    try:
        command = NackCommand(
            text(data, "subscription"),
            text(data, "topic"),
            count(data, "partition"),
            count(data, "offset"),
            None,
            count(data, "deliver_at"),
            count(data, "redelivery_count"),
        )
        source = (control_topic, count(data, "command_partition"), count(data, "command_offset"))
        return AcceptedNack(command, count(data, "deliver_at"), source, data.get("cancelled") is True)
    except RejectedRecord:
        return None
