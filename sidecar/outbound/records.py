"""Headers of the records the sidecar writes (contract sections 3 and 4). Pure code.

Every output record carries its origin (topic, partition, offset): that is the message id that
consumers nack with, that auditors join on, and that makes duplicates detectable downstream.

Deliveries come in two forms. The compact form (the default) is two headers, `delay-origin:
topic/partition/offset` and `delay-deliver-at`, with `delay-redelivery-count` only above 0: every
header costs the producer a conversion per record, and a delivery is the hot path. The v1 form
(`--outbound-headers v1`) keeps the origin in three headers and always writes the count, for
consumers written against it. Dead letters keep the v1 origin headers: they are rare, and the
tools that read them do not change. Topic names cannot hold a `/`, so the compact origin splits
unambiguously.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from sidecar.policy.headers import Headers

HeaderForm = Literal["compact", "v1"]
ORIGIN = "delay-origin"
ORIGIN_TOPIC = "delay-origin-topic"
ORIGIN_PARTITION = "delay-origin-partition"
ORIGIN_OFFSET = "delay-origin-offset"
DELIVER_AT = "delay-deliver-at"
REDELIVERY_COUNT = "delay-redelivery-count"
ERROR_CODE = "delay-error-code"
ERROR_MESSAGE = "delay-error-message"

OutHeaders = list[tuple[str, bytes]]


def origin_headers(topic: str, partition: int, offset: int) -> OutHeaders:
    return [
        (ORIGIN_TOPIC, topic.encode()),
        (ORIGIN_PARTITION, str(partition).encode()),
        (ORIGIN_OFFSET, str(offset).encode()),
    ]


def _copy(original: Headers) -> OutHeaders:
    return [(name, value if value is not None else b"") for name, value in original] if original else []


def outbound_headers(
    original: Headers,
    topic: str,
    partition: int,
    offset: int,
    deliver_at: int,
    redelivery_count: int = 0,
    form: HeaderForm = "compact",
) -> OutHeaders:
    headers = _copy(original)
    if form == "compact":
        headers.append((ORIGIN, f"{topic}/{partition}/{offset}".encode()))
        headers.append((DELIVER_AT, str(deliver_at).encode()))
        if redelivery_count:
            headers.append((REDELIVERY_COUNT, str(redelivery_count).encode()))
        return headers
    headers += origin_headers(topic, partition, offset)
    headers.append((DELIVER_AT, str(deliver_at).encode()))
    headers.append((REDELIVERY_COUNT, str(redelivery_count).encode()))
    return headers


@dataclass(frozen=True, slots=True)
class Delivered:
    """What a delivery's headers say, in either form."""

    topic: str
    partition: int
    offset: int
    deliver_at: int
    redelivery_count: int


def read_delivery(headers: Mapping[str, bytes]) -> Delivered:
    """The origin, deliver-at and redelivery count of a delivery in either header form.

    ValueError names the header that is missing or malformed."""
    try:
        compact = headers.get(ORIGIN)
        if compact is not None:
            topic, partition, offset = compact.decode().rsplit("/", 2)
        else:
            topic = headers[ORIGIN_TOPIC].decode()
            partition, offset = headers[ORIGIN_PARTITION].decode(), headers[ORIGIN_OFFSET].decode()
        return Delivered(
            topic, int(partition), int(offset), int(headers[DELIVER_AT]), int(headers.get(REDELIVERY_COUNT, b"0"))
        )
    except (KeyError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not a delivery of the delay sidecar: its headers lack {ORIGIN!r} or {ORIGIN_TOPIC!r} "
                         f"and {DELIVER_AT!r}, or one is malformed ({e})") from e  # fmt: skip


def dead_letter_headers(
    original: Headers, topic: str, partition: int, offset: int, code: str, message: str
) -> OutHeaders:
    headers = _copy(original)
    headers.append((ERROR_CODE, code.encode()))
    headers.append((ERROR_MESSAGE, message.encode()))
    headers += origin_headers(topic, partition, offset)
    return headers
