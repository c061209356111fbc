"""The Kafka edge's small helpers: client logs without floods, and the brokers' reachability."""

import logging

import pytest
from confluent_kafka import KafkaError

from sidecar.kafka_io import Connectivity, RepeatFilter, is_fatal


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
