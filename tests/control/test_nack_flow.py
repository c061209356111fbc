"""Consumer-side delayed nacks through the control topic, against a real broker (contract section 5)."""

import json
import os
import signal
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer

from sidecar.client import Nacker
from sidecar.outbound.records import DELIVER_AT, ERROR_CODE, ORIGIN_OFFSET, REDELIVERY_COUNT
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    Received,
    ThreadedSidecar,
    TopicFactory,
    settings_for,
    sidecar_process,
)


class RecordView:
    """A Received record seen through the interface sidecar.client reads (a confluent Message)."""

    def __init__(self, record: Received) -> None:
        self._record = record

    def headers(self) -> list[tuple[str, bytes]]:
        return list(self._record.headers.items())

    def topic(self) -> str:
        return self._record.topic


def setup(topic: str, policy_file: PolicyFile, max_delay: str = "0") -> Path:
    return policy_file(f"""
topics:
  {topic}:
    delayed_delivery: {{max_delivery_delay: {max_delay}}}
    subscriptions: {{billing: {{}}, fraud: {{}}}}
""")


def test_each_nacked_message_comes_back_once_on_its_own_subscription(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, control = topic_factory("nack"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka, setup(topic, policy_file), tmp_path, control_topic=control)
    with ThreadedSidecar(settings) as sidecar:
        for i in range(20):
            kafka_helper.produce(topic, f"v{i}".encode())
        kafka_helper.flush()
        first = kafka_helper.read(f"{topic}.billing", 20)
        nacker = Nacker(Producer({"bootstrap.servers": kafka}), control_topic=control, subscription="billing")
        nacked_at = {}
        for record in first:
            nacker.nack(RecordView(record), 1000)  # type: ignore[arg-type]
            nacked_at[record.headers[ORIGIN_OFFSET]] = time.time() * 1000
        nacker.flush()
        billing = kafka_helper.read(f"{topic}.billing", 40, timeout_s=20, extra_s=1.5)
        again = [r for r in billing if r.headers[REDELIVERY_COUNT] == b"1"]
        assert len(billing) == 40 and len(again) == 20
        assert sorted(r.headers[ORIGIN_OFFSET] for r in again) == sorted(nacked_at)
        for r in again:
            assert r.timestamp >= r.header_int(DELIVER_AT), "redelivered early"
            assert r.received_ms - nacked_at[r.headers[ORIGIN_OFFSET]] >= 1000 - 50
            assert r.value == b"v" + r.headers[ORIGIN_OFFSET]
        fraud = kafka_helper.read(f"{topic}.fraud", 20, extra_s=1.0)
        assert len(fraud) == 20 and all(r.headers[REDELIVERY_COUNT] == b"0" for r in fraud)
        assert sidecar.metric("delay_sidecar_redeliveries_total", subscription="billing") == 20
        assert sidecar.metric("delay_sidecar_nack_total", subscription="billing", result="accepted") == 20


def test_latest_nack_for_the_same_message_wins(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, control = topic_factory("latest"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka, setup(topic, policy_file), tmp_path, control_topic=control)
    with ThreadedSidecar(settings):
        kafka_helper.produce(topic, b"m")
        kafka_helper.flush()
        [record] = kafka_helper.read(f"{topic}.billing", 1)
        nacker = Nacker(Producer({"bootstrap.servers": kafka}), control_topic=control, subscription="billing")
        nacker.nack(RecordView(record), 600_000)  # type: ignore[arg-type]
        nacker.nack(RecordView(record), 1500)  # type: ignore[arg-type]
        nacker.flush()
        sent = time.time() * 1000
        records = kafka_helper.read(f"{topic}.billing", 2, timeout_s=10, extra_s=2.0)
        assert [r.headers[REDELIVERY_COUNT] for r in records] == [b"0", b"1"]
        assert records[1].received_ms - sent >= 1400
        # And the other way round: a later, longer nack replaces a shorter one.
        nacker.nack(RecordView(records[1]), 1000)  # type: ignore[arg-type]
        nacker.nack(RecordView(records[1]), 600_000)  # type: ignore[arg-type]
        nacker.flush()
        assert len(kafka_helper.read(f"{topic}.billing", 3, timeout_s=3)) == 2


def test_invalid_commands_get_their_own_code_and_the_sidecar_keeps_serving(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, control = topic_factory("badnack"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka, setup(topic, policy_file, max_delay="1m"), tmp_path, control_topic=control)
    with ThreadedSidecar(settings) as sidecar:
        kafka_helper.produce(topic, b"m")
        kafka_helper.flush()
        kafka_helper.read(f"{topic}.billing", 1)

        def nack(**fields: object) -> bytes:
            body = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0, "offset": 0,
                    "delay_ms": 1000}  # fmt: skip
            body.update(fields)
            return json.dumps(body).encode()

        # One control partition, so the origin offsets give the order sent.
        for value in (b"{oops", nack(subscription="nobody"), nack(offset=99), nack(delay_ms=120_000)):
            kafka_helper.produce(control, value, partition=0)
        kafka_helper.produce(control, nack(), partition=0)
        kafka_helper.flush()
        dead = kafka_helper.read(f"{control}.dlt", 4, extra_s=0.5)
        dead.sort(key=lambda r: int(r.headers[ORIGIN_OFFSET]))  # unkeyed: spread over the DLT's partitions
        assert [r.headers[ERROR_CODE] for r in dead] == [
            b"INVALID_COMMAND", b"UNKNOWN_SUBSCRIPTION", b"UNKNOWN_MESSAGE", b"EXCEEDS_MAX_DELAY"
        ]  # fmt: skip
        assert dead[0].value == b"{oops"
        # The valid command after them still works.
        assert [r.headers[REDELIVERY_COUNT] for r in kafka_helper.read(f"{topic}.billing", 2)] == [b"0", b"1"]
        # A command's subscription becomes a metric label only when it is configured.
        samples = sidecar.app.metrics.registry.get_sample_value
        assert samples("delay_sidecar_nack_total", {"subscription": "nobody", "result": "unknown_subscription"}) is None
        assert samples("delay_sidecar_nack_total", {"subscription": "(unknown)", "result": "unknown_subscription"}) == 1


def test_1000_nacks_survive_kill_9(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, control = topic_factory("nackcrash", partitions=2), f"ctl-{uuid.uuid4().hex[:8]}"
    args = ["--bootstrap-servers", kafka, "--policies", str(setup(topic, policy_file)), "--state-dir",
            str(tmp_path / "state"), "--metrics-port", "0", "--group-id", f"g-{control}", "--control-topic", control,
            "--commit-interval-ms", "100"]  # fmt: skip
    log = tmp_path / "sidecar.log"
    first = sidecar_process(args, log)
    try:
        for i in range(1000):
            kafka_helper.produce(topic, f"v{i}".encode(), partition=i % 2)
        kafka_helper.flush()
        delivered = kafka_helper.read(f"{topic}.billing", 1000, timeout_s=30)
        assert len(delivered) == 1000, log.read_text()[-2000:]
        nacker = Nacker(Producer({"bootstrap.servers": kafka}), control_topic=control, subscription="billing")
        for record in delivered:
            nacker.nack(RecordView(record), 4000)  # type: ignore[arg-type]
        nacker.flush()
        time.sleep(0.5)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    second = sidecar_process(args, log)
    try:
        records = kafka_helper.read(f"{topic}.billing", 2000, timeout_s=40)
        again = {(r.headers["delay-origin-partition"], r.headers[ORIGIN_OFFSET]) for r in records
                 if r.headers[REDELIVERY_COUNT] == b"1"}  # fmt: skip
        assert len(again) == 1000, log.read_text()[-2000:]
        assert all(r.timestamp >= r.header_int(DELIVER_AT) for r in records)
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, log.read_text()[-2000:]


def test_nacks_already_due_when_read_are_redelivered_not_dropped(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """A sidecar that reads commands after their time (a backlog, a restart) redelivers them at once."""
    topic, control = topic_factory("latenack"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka, setup(topic, policy_file), tmp_path, control_topic=control)
    with ThreadedSidecar(settings) as sidecar:
        for i in range(300):
            kafka_helper.produce(topic, f"v{i}".encode())
        kafka_helper.flush()
        first = kafka_helper.read(f"{topic}.billing", 300)
        sent_long_ago = int(time.time() * 1000) - 10_000
        for record in first:
            command = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0,
                       "offset": int(record.headers[ORIGIN_OFFSET]), "delay_ms": 1000}  # fmt: skip
            kafka_helper.produce(control, json.dumps(command).encode(), timestamp=sent_long_ago)
        kafka_helper.flush()
        again = [
            r for r in kafka_helper.read(f"{topic}.billing", 600, timeout_s=20) if r.headers[REDELIVERY_COUNT] == b"1"
        ]
        assert len({r.headers[ORIGIN_OFFSET] for r in again}) == 300
        assert sidecar.metric("delay_sidecar_redeliveries_total", subscription="billing") == 300
