"""Headers of the records the sidecar writes (contract sections 3 and 4). Pure code.

Every output record carries its origin (topic, partition, offset): that is the message id that
consumers nack with, that auditors join on, and that makes duplicates detectable downstream.
"""

from sidecar.policy.headers import Headers

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
    original: Headers, topic: str, partition: int, offset: int, deliver_at: int, redelivery_count: int = 0
) -> OutHeaders:
    headers = _copy(original)
    headers += origin_headers(topic, partition, offset)
    headers.append((DELIVER_AT, str(deliver_at).encode()))
    headers.append((REDELIVERY_COUNT, str(redelivery_count).encode()))
    return headers


def dead_letter_headers(
    original: Headers, topic: str, partition: int, offset: int, code: str, message: str
) -> OutHeaders:
    headers = _copy(original)
    headers.append((ERROR_CODE, code.encode()))
    headers.append((ERROR_MESSAGE, message.encode()))
    headers += origin_headers(topic, partition, offset)
    return headers
