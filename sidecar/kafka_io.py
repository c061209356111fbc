"""Small helpers for the Kafka edge that the intake and the log reader share."""

from confluent_kafka import Consumer, Message


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
