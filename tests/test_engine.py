"""The whole path through a real broker: inbound -> policy -> tracker -> dispatch -> outbound."""

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sidecar.outbound.records import (
    DELIVER_AT,
    ERROR_CODE,
    ERROR_MESSAGE,
    ORIGIN_OFFSET,
    ORIGIN_PARTITION,
    ORIGIN_TOPIC,
    REDELIVERY_COUNT,
)
from tests.kafka_helpers import KafkaHelper, ThreadedSidecar, settings_for, sidecar_process


def two_subscriptions(topic: str) -> str:
    return f"""
topics:
  {topic}:
    subscriptions:
      billing: {{}}
      shipping: {{}}
"""


def test_deliver_after_reaches_both_subscriptions_on_time(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    topic = topic_factory("orders")
    settings = settings_for(kafka, policy_file(two_subscriptions(topic)), tmp_path)
    with ThreadedSidecar(settings) as sidecar:
        kafka_helper.produce(topic, b"v", b"k", headers=[("deliver-after", "2s"), ("trace", "x")])
        kafka_helper.flush()
        for sub in ("billing", "shipping"):
            [record] = kafka_helper.read(f"{topic}.{sub}", 1, timeout_s=15)
            deliver_at = record.header_int(DELIVER_AT)
            assert record.timestamp >= deliver_at, "delivered early"
            assert (record.key, record.value) == (b"k", b"v")
            assert record.headers["trace"] == b"x" and record.headers["deliver-after"] == b"2s"
            assert record.headers[REDELIVERY_COUNT] == b"0"
        assert sidecar.metric("delay_sidecar_messages_delayed_total", topic=topic) == 1
        assert sidecar.metric("delay_sidecar_messages_delivered_total", topic=topic, subscription="billing") == 1


def test_records_without_delay_pass_straight_through_with_origin(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    topic = topic_factory("plain", partitions=2)
    settings = settings_for(kafka, policy_file(two_subscriptions(topic)), tmp_path)
    with ThreadedSidecar(settings):
        for i in range(20):
            kafka_helper.produce(topic, f"v{i}".encode(), f"k{i}".encode(), partition=i % 2)
        kafka_helper.flush()
        for sub in ("billing", "shipping"):
            records = kafka_helper.read(f"{topic}.{sub}", 20, extra_s=0.5)
            assert len(records) == 20
            origins = {
                (r.headers[ORIGIN_TOPIC], int(r.headers[ORIGIN_PARTITION]), int(r.headers[ORIGIN_OFFSET]))
                for r in records
            }
            assert origins == {(topic.encode(), p, o) for p in (0, 1) for o in range(10)}
            for r in records:
                assert r.headers[DELIVER_AT] and r.received_ms - r.header_int(DELIVER_AT) < 5000


def test_invalid_header_lands_on_dead_letter_topic_with_code_and_origin(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    topic = topic_factory("bad")
    settings = settings_for(kafka, policy_file(two_subscriptions(topic)), tmp_path)
    with ThreadedSidecar(settings) as sidecar:
        # A timestamp of its own, recent enough that retention keeps the record.
        published = int(time.time() * 1000) - 12_345
        kafka_helper.produce(topic, b"v", b"k", headers=[("deliver-after", "tomorrow")], timestamp=published)
        kafka_helper.produce(topic, b"good", b"k2")
        kafka_helper.flush()
        [dead] = kafka_helper.read(f"{topic}.dlt", 1, extra_s=0.5)
        assert dead.headers[ERROR_CODE] == b"INVALID_DELAY_HEADER"
        assert b"tomorrow" in dead.headers[ERROR_MESSAGE]
        assert (dead.headers[ORIGIN_TOPIC], dead.headers[ORIGIN_PARTITION], dead.headers[ORIGIN_OFFSET]) == (
            topic.encode(),
            b"0",
            b"0",
        )
        assert (dead.key, dead.value, dead.timestamp) == (b"k", b"v", published)
        assert dead.headers["deliver-after"] == b"tomorrow"
        # The rejected record goes nowhere else; the next one flows on.
        billing = kafka_helper.read(f"{topic}.billing", 1, extra_s=0.5)
        assert [r.value for r in billing] == [b"good"]
        assert (
            sidecar.metric(
                "delay_sidecar_messages_delayed_rejected_total", topic=topic, namespace="", code="INVALID_DELAY_HEADER"
            )
            == 1
        )


@pytest.mark.parametrize("tracker", ["bucket", "memory"])
def test_kill_9_with_1000_pending_loses_nothing_and_delivers_nothing_early(
    tracker: str,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    topic = topic_factory("crash", partitions=3)
    policies = policy_file(two_subscriptions(topic))
    args = [
        "--bootstrap-servers",
        kafka,
        "--policies",
        str(policies),
        "--state-dir",
        str(tmp_path / "state"),
        "--metrics-port",
        "0",
        "--group-id",
        f"crash-{topic}",
        "--commit-interval-ms",
        "100",
        "--tracker",
        tracker,
    ]
    log = tmp_path / "sidecar.log"
    first = sidecar_process(args, log)
    try:
        now = int(time.time() * 1000)
        for i in range(1000):
            deliver_at = now + 6000 + (i % 50) * 40  # due 6-8 s from now, so all are pending at the kill
            kafka_helper.produce(topic, f"v{i}".encode(), f"k{i}".encode(), headers=[("deliver-at", str(deliver_at))])
        kafka_helper.flush()
        time.sleep(3)  # indexed and committed at least once
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    assert kafka_helper.end_offsets(f"{topic}.billing", 3) == [0, 0, 0], log.read_text()[-3000:]
    second = sidecar_process(args, log)
    try:
        for sub in ("billing", "shipping"):
            records = kafka_helper.read(f"{topic}.{sub}", 1000, timeout_s=40)
            values = {r.value for r in records}
            assert values == {f"v{i}".encode() for i in range(1000)}, log.read_text()[-3000:]
            assert all(r.timestamp >= r.header_int(DELIVER_AT) for r in records), "delivered early"
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, log.read_text()[-3000:]


def test_interleaved_immediate_and_delayed_keep_order_with_concurrent_readers(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    topic = topic_factory("mixed")
    settings = settings_for(kafka, policy_file(two_subscriptions(topic)), tmp_path)
    with ThreadedSidecar(settings):
        base = int(time.time() * 1000) + 2000
        for i in range(1000):
            headers = [("deliver-at", str(base + (i % 10) * 100))] if i % 2 else []
            kafka_helper.produce(topic, f"{i}".encode(), headers=headers)
        kafka_helper.flush()
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda sub: kafka_helper.read(f"{topic}.{sub}", 1000), ["billing", "shipping"]))
    for records in results:
        offsets = [int(r.headers[ORIGIN_OFFSET]) for r in records]
        immediate = [o for o in offsets if o % 2 == 0]
        delayed = [o for o in offsets if o % 2]
        assert immediate == list(range(0, 1000, 2))  # inbound order
        assert delayed == sorted(delayed, key=lambda o: (base + (o % 10) * 100, o))  # deliver-at, then FIFO
        assert len(set(offsets)) == 1000
        assert all(r.timestamp >= r.header_int(DELIVER_AT) for r in records)
