"""The whole path through a real broker: inbound -> policy -> tracker -> dispatch -> outbound."""

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sidecar.broker.ports import free_port
from sidecar.outbound.records import (
    DELIVER_AT,
    ERROR_CODE,
    ERROR_MESSAGE,
    ORIGIN_OFFSET,
    ORIGIN_PARTITION,
    ORIGIN_TOPIC,
    REDELIVERY_COUNT,
)
from tests.kafka_helpers import (
    KafkaHelper,
    ThreadedSidecar,
    committed,
    deliveries,
    early,
    outbound_end,
    settings_for,
    sidecar_process,
    wait_for,
    wait_serving,
)

pytestmark = pytest.mark.fallback  # the fallback broker runs these too (scripts/test.sh)


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
        # Far enough ahead that the record is not due yet when a busy machine's intake reads it.
        kafka_helper.produce(topic, b"v", b"k", headers=[("deliver-after", "7s"), ("trace", "x")])
        kafka_helper.flush()
        for sub in ("billing", "shipping"):
            [record] = kafka_helper.read(f"{topic}.{sub}", 1, timeout_s=30)
            deliver_at = record.header_int(DELIVER_AT)
            assert record.timestamp >= deliver_at, "delivered early"
            assert (record.key, record.value) == (b"k", b"v")
            assert record.headers["trace"] == b"x" and record.headers["deliver-after"] == b"7s"
            assert record.headers[REDELIVERY_COUNT] == b"0"
            # The compact form: two headers of the sidecar's own after the producer's, no count at 0.
            assert record.wire == [
                ("deliver-after", b"7s"),
                ("trace", b"x"),
                ("delay-origin", f"{topic}/0/0".encode()),
                ("delay-deliver-at", b"%d" % deliver_at),
            ]
        assert sidecar.metric("delay_sidecar_messages_delayed_total", topic=topic) == 1
        assert sidecar.metric("delay_sidecar_messages_delivered_total", topic=topic, subscription="billing") == 1


@pytest.mark.parametrize("form", ["compact", "v1"])
def test_records_without_delay_pass_straight_through_with_origin(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
    form: str,
) -> None:
    topic = topic_factory("plain", partitions=2)
    settings = settings_for(kafka, policy_file(two_subscriptions(topic)), tmp_path, outbound_headers=form)
    own = {"compact": ["delay-origin", "delay-deliver-at"],
           "v1": [ORIGIN_TOPIC, ORIGIN_PARTITION, ORIGIN_OFFSET, DELIVER_AT, REDELIVERY_COUNT]}[form]  # fmt: skip
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
                assert [name for name, _ in r.wire or []] == own


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
    port = free_port()
    args = [
        "--bootstrap-servers",
        kafka,
        "--policies",
        str(policies),
        "--state-dir",
        str(tmp_path / "state"),
        "--metrics-port",
        str(port),
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
        # Serving before the deliver-ats are taken: however slowly the process starts, none is due at intake.
        wait_serving(port)
        now = int(time.time() * 1000)
        for i in range(1000):
            deliver_at = now + 6000 + (i % 50) * 40  # due 6-8 s from now, so all are pending at the kill
            kafka_helper.produce(topic, f"v{i}".encode(), f"k{i}".encode(), headers=[("deliver-at", str(deliver_at))])
        kafka_helper.flush()
        group = f"crash-{topic}"
        wait_for(lambda: sum(o for o, _ in committed(kafka, group, topic, 3)) == 1000, 30, "indexed and committed")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    assert kafka_helper.end_offsets(f"{topic}.billing", 3) == [0, 0, 0], log.read_text()[-3000:]
    second = sidecar_process(args, log)
    try:
        for sub in ("billing", "shipping"):
            wait_for(lambda s=sub: outbound_end(kafka_helper, f"{topic}.{s}", 3) >= 1000, 40, f"{sub} delivered")
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, log.read_text()[-3000:]
    for sub in ("billing", "shipping"):
        records = kafka_helper.read_to_end(f"{topic}.{sub}")
        assert sorted(deliveries(records).values()) == [1] * 1000, log.read_text()[-3000:]
        assert not early(records), "delivered early"


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
        base = int(time.time() * 1000) + 7000  # none due at intake: they go out in deliver-at order
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


def test_changing_a_subscription_type_neither_loses_nor_repeats_records(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    """A delayed record is owed to the subscriptions that honoured delays when it arrived."""
    topic = topic_factory("retype")

    def policy(kind: str) -> str:
        return f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}, b: {{type: {kind}}}}}\n"

    def produce(first: int, delay: str) -> None:
        for i in range(first, first + 100):
            kafka_helper.produce(topic, f"v{i}".encode(), headers=[("deliver-after", delay)])
        kafka_helper.flush()

    path = policy_file(policy("shared"))
    with ThreadedSidecar(settings_for(kafka, path, tmp_path)) as sidecar:
        delayed = lambda: sidecar.metric("delay_sidecar_messages_delayed_total", topic=topic)  # noqa: E731
        generation = lambda: sidecar.metric("delay_sidecar_policy_generation")  # noqa: E731
        produce(0, "9s")  # owed to a and b at their deliver-at
        wait_for(lambda: delayed() == 100, 30, "indexing")
        path.write_text(policy("exclusive"))
        wait_for(lambda: generation() == 2, 30, "b exclusive")
        produce(100, "4s")  # b gets these at once, a at their deliver-at
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.b") >= 200, 30, "b")
        path.write_text(policy("shared"))
        wait_for(lambda: generation() == 3, 30, "b shared again")
        produce(200, "1s")  # owed to both again
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= 300, 30, "a")
        wait_for(lambda: sidecar.metric("delay_sidecar_tracked_messages", topic=topic) == 0, 30, "nothing pending")
    for sub in ("a", "b"):
        records = kafka_helper.read_to_end(f"{topic}.{sub}")
        assert sorted(deliveries(records).values()) == [1] * 300, sub
        assert not early(records)


def test_one_partition_in_the_same_partition_out(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = topic_factory("order", partitions=3)
    odd = topic_factory("odd", partitions=2)  # an existing outbound topic with another partition count
    path = policy_file(f"""
topics:
  {topic}:
    subscriptions:
      audit: {{type: exclusive}}
      work: {{}}
      odd: {{outbound: {odd}}}
""")
    with ThreadedSidecar(settings_for(kafka, path, tmp_path)) as sidecar:
        for i in range(3_000):
            kafka_helper.produce(topic, f"p0-{i}".encode(), partition=0)
        due = str(int(time.time() * 1000) + 1_000)
        for i in range(1_000):
            kafka_helper.produce(topic, f"p1-{i}".encode(), headers=[("deliver-at", due)], partition=1)
        kafka_helper.flush()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.work", 3) >= 4_000, 30, "deliveries")
        wait_for(lambda: sidecar.metric("delay_sidecar_tracked_messages", topic=topic) == 0, 30, "nothing pending")
    for sub in ("audit", "work"):
        records = kafka_helper.read_to_end(f"{topic}.{sub}")
        assert all(r.partition == int(r.headers[ORIGIN_PARTITION]) for r in records), sub
        for partition in (0, 1):
            offsets = [int(r.headers[ORIGIN_OFFSET]) for r in records if r.partition == partition]
            assert offsets == sorted(offsets) and len(offsets) == (3_000 if partition == 0 else 1_000), sub
    assert len(kafka_helper.read_to_end(odd)) == 4_000
    assert "outbound topic has a different partition count from its inbound topic" in caplog.text
    assert f"topic={odd} partitions=2" in caplog.text


def test_a_stop_closes_every_reader_once(
    kafka: str, topic_factory: Callable[..., str], policy_file: Callable[[str], Path], tmp_path: Path
) -> None:
    topic = topic_factory("close")
    with ThreadedSidecar(settings_for(kafka, policy_file(two_subscriptions(topic)), tmp_path)) as sidecar:
        engine = sidecar.app.sidecar
        assert engine is not None
    for reader in (engine._ahead_reader, engine._reader):
        with pytest.raises(RuntimeError, match="closed"):
            reader._consumer.assignment()
