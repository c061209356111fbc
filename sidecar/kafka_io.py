"""Small helpers for the Kafka edge that the intake and the log reader share."""

from typing import Any

from confluent_kafka import Consumer, Message

# Some brokers (noida-db among them) answer a fetch with more than fetch.max.bytes; librdkafka
# then rejects the response ("Invalid response size") and retries forever. Accept up to 512 MiB,
# and bound what is queued in memory per partition instead.
CONSUMER_DEFAULTS: dict[str, Any] = {
    "receive.message.max.bytes": 512 * 1024 * 1024,
    "queued.max.messages.kbytes": 32 * 1024,
    "fetch.wait.max.ms": 10,
}


def consumer_config(client_config: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """Settings of every consumer the sidecar opens: the shared defaults, the client's, then its own."""
    return {**CONSUMER_DEFAULTS, **client_config, **overrides}


def consume_batch(consumer: Consumer, max_records: int, wait_s: float) -> list[Message]:
    """What is buffered, at once; otherwise wait until one record arrives or wait_s passes.

    Consumer.consume(n, timeout) blocks for the whole timeout unless n records arrive, which would
    add up to `timeout` of lateness to every delivery; poll() returns at the first record.
    """
    records: list[Message] = consumer.consume(max_records, 0)
    if records or wait_s <= 0:
        return records
    first = consumer.poll(wait_s)
    if first is None:
        return []
    return [first, *consumer.consume(max_records - 1, 0)]
