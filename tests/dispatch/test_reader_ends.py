"""A partition's end asked of a broker that cannot answer for a moment: asked again, never taken as 0."""

import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from sidecar.dispatch.reader import LogReader, NoSuchPartition
from sidecar.errors import BrokerError


class Flaky:
    """A consumer whose watermark answers fail with `errors` first, then give (0, high)."""

    def __init__(self, errors: list[int], high: int = 5) -> None:
        self.errors, self.high, self.asked = errors, high, 0

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        self.asked += 1
        if self.errors:
            raise KafkaException(KafkaError(self.errors.pop(0)))
        return 0, self.high


def reader_on(consumer: Any) -> LogReader:
    reader = LogReader.__new__(LogReader)
    reader._consumer, reader._stop = consumer, threading.Event()
    return reader


def test_a_timed_out_answer_is_asked_again() -> None:
    """Before: a timeout counted as an end of 0, and a nack of a delivered message was refused
    UNKNOWN_MESSAGE on a 3-node cluster ("has no offset 1 (its end is 0)")."""
    consumer = Flaky([KafkaError._TIMED_OUT, KafkaError.NOT_LEADER_FOR_PARTITION])
    assert reader_on(consumer).watermarks("t", 0) == (0, 5)
    assert consumer.asked == 3


def test_a_broker_that_never_answers_starts_the_engine_again() -> None:
    consumer = Flaky([KafkaError._TIMED_OUT] * 100)
    with pytest.raises(BrokerError, match="starts again from its last checkpoint"):
        reader_on(consumer).watermarks("t", 0, deadline_s=0.5)


def test_a_partition_that_does_not_exist_is_said_so_at_once() -> None:
    consumer = Flaky([KafkaError.UNKNOWN_TOPIC_OR_PART] * 100)
    with pytest.raises(NoSuchPartition):
        reader_on(consumer).watermarks("t", 0)
    assert consumer.asked > 1  # a client without the topic in its metadata yet says the same, briefly
