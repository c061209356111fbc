"""The Kafka edge's small helpers: client logs without floods, and the brokers' reachability."""

import logging
import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaError, Message
from hypothesis import given
from hypothesis import strategies as st

from sidecar.broker.admin import TopicAdmin, replication
from sidecar.kafka_io import LIBRDKAFKA, Connectivity, RepeatFilter, consume_batch, consumer_config, is_fatal


class TruncatingConsumer:
    """Takes timeouts as confluent-kafka does: seconds as a float, cut down to whole milliseconds."""

    def __init__(self) -> None:
        self.waited_ms: list[int] = []

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        return []

    def poll(self, timeout: float) -> Message | None:
        self.waited_ms.append(int(timeout * 1000))
        return None


@given(st.floats(min_value=1e-6, max_value=600, allow_nan=False))
def test_a_wait_for_nothing_blocks_at_least_as_long_as_asked(wait_s: float) -> None:
    """A wait under a millisecond cut down to 0 returned at once, and an idle loop spun until the
    instant it waited for (1,000 turns a second of an idle sidecar pacing its partitions)."""
    consumer = TruncatingConsumer()
    assert consume_batch(consumer, 10, wait_s) == []  # type: ignore[arg-type]
    [waited_ms] = consumer.waited_ms
    assert wait_s * 1000 - 1e-9 <= waited_ms <= wait_s * 1000 + 1


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("librdkafka", logging.ERROR, __file__, 1, message, None, None)


def test_a_repeated_client_error_is_logged_once_then_with_its_count(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("sidecar.kafka_io.time.monotonic", lambda: now[0])
    repeats = RepeatFilter(window_s=60)
    line = "FAIL [thrd:127.0.0.1:9092/bootstrap]: Connect to ipv4#127.0.0.1:9092 failed (after {}ms in state CONNECT)"
    assert repeats.filter(record(line.format(0)))
    assert not any(repeats.filter(record(line.format(n))) for n in range(1, 400))  # one every 50 ms
    assert repeats.filter(record("another error"))
    now[0] += 61
    again = record(line.format(7))
    assert repeats.filter(again) and again.getMessage().endswith("repeated=399")


def test_connectivity_goes_down_on_a_transport_error_and_up_on_the_first_metadata_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr("sidecar.kafka_io.time.monotonic", lambda: now[0])
    asked: list[float] = []
    brokers_answer = [False]

    def answers() -> bool:
        asked.append(now[0])
        return brokers_answer[0]

    connectivity = Connectivity()
    connectivity.on_error(KafkaError(KafkaError._MSG_TIMED_OUT))
    connectivity.on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "0/2 brokers are down"))  # none is
    # One broker of several away is no outage (before: every exactly-once transaction was aborted
    # while a node was down, and a rolling restart started an engine again 21 times).
    connectivity.on_error(KafkaError(KafkaError._TRANSPORT, "127.0.0.1:9093/2: Connect failed: Connection refused"))
    connectivity.watch(True, answers)
    assert connectivity.reason is None and not asked
    connectivity.on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "3/3 brokers are down"))
    assert connectivity.reason is not None and "3/3 brokers are down" in connectivity.reason
    connectivity.watch(False, answers)
    connectivity.watch(False, answers)
    assert asked == [1000.0]  # then every PROBE_EVERY_S
    # Records fetched before the brokers went are no proof (before: /healthz flipped to ready on them).
    now[0] += Connectivity.PROBE_ON_RECORDS_S
    connectivity.watch(True, answers)
    assert len(asked) == 2 and connectivity.reason is not None
    now[0] += Connectivity.PROBE_EVERY_S
    brokers_answer[0] = True
    connectivity.watch(False, answers)
    assert connectivity.reason is None and connectivity.outages == 1


def test_a_consumers_fatal_event_is_fatal_though_its_flag_is_not_set() -> None:
    """What `consume` hands over after a fatal error: code _FATAL, fatal() False."""
    handed = KafkaError(KafkaError._FATAL)
    assert not handed.fatal() and is_fatal(handed)
    assert is_fatal(KafkaError(KafkaError._TRANSPORT, fatal=True))
    assert not is_fatal(KafkaError(KafkaError._PARTITION_EOF))
    assert not is_fatal(KafkaError(KafkaError._TRANSPORT))


def test_a_topic_created_after_the_subscription_is_assigned_at_the_next_refresh(
    kafka: str, topic_factory: Callable[..., str]
) -> None:
    """Apache Kafka tells brokers of a new topic after its controller has created it, so a consumer
    that subscribed in between learns of it at its next metadata refresh: librdkafka's default is
    5 minutes, and a control topic's commands waited that long. Here the consumer subscribes first,
    beside a topic that exists (with none, librdkafka keeps asking)."""
    known, name = topic_factory("known"), f"later-{uuid.uuid4().hex[:10]}"
    consumer = Consumer(consumer_config({"bootstrap.servers": kafka}, **{"group.id": name}), logger=LIBRDKAFKA)
    try:
        consumer.subscribe([known, name])
        joined = time.monotonic() + 60
        while not consumer.assignment() and time.monotonic() < joined:  # the known topic only
            consumer.poll(0.5)
        assert [tp.topic for tp in consumer.assignment()] == [known]
        TopicAdmin({"bootstrap.servers": kafka}, 1).create({name: 1})
        deadline = time.monotonic() + 90
        while len(consumer.assignment()) < 2 and time.monotonic() < deadline:
            consumer.poll(0.5)
        assert sorted(tp.topic for tp in consumer.assignment()) == sorted([known, name])
    finally:
        consumer.close()


@pytest.mark.parametrize(
    ("explicit", "broker_default", "brokers", "expected"),
    [
        (None, 1, 1, (1, 1)),  # a single broker: nothing to replicate to
        (None, 1, 2, (2, 1)),
        (None, 1, 3, (3, 2)),  # Kafka's default of 1, raised
        (None, 1, 5, (3, 2)),
        (None, 4, 5, (4, 3)),  # an operator's higher default is kept
        (2, 1, 5, (2, 1)),  # --replication-factor wins
    ],
)
def test_new_topics_are_replicated_by_the_broker_default_or_min_3_brokers(
    explicit: int | None, broker_default: int, brokers: int, expected: tuple[int, int]
) -> None:
    assert replication(explicit, broker_default, brokers) == expected


def test_checkpoints_put_off_for_a_while_keep_healthz_unready_until_one_is_committed_whatever_metadata_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two nodes of three away: the third answers metadata, but no write is acknowledged. A leader
    that moves holds writes for a few seconds: not an outage (CI: 3 s, and /healthz went 503)."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    connectivity = Connectivity()
    connectivity.acknowledging(put_off=True)
    now[0] += Connectivity.UNACKNOWLEDGED_S - 1
    connectivity.acknowledging(put_off=True)
    assert connectivity.unacknowledged is None  # a leader moving
    now[0] += 2
    assert connectivity.unacknowledged is not None
    connectivity.up()  # what a metadata answer does
    assert connectivity.unacknowledged is not None
    connectivity.acknowledging(put_off=False)
    assert connectivity.unacknowledged is None
