"""Accepted nacks are durable: they survive the loss of local state, and are redelivered once."""

import json
import uuid
from pathlib import Path

from confluent_kafka import Producer

from sidecar.broker.ports import free_port
from sidecar.outbound.records import ORIGIN_OFFSET, ORIGIN_PARTITION, REDELIVERY_COUNT
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    TopicFactory,
    committed,
    deliveries,
    early,
    outbound_end,
    scrape,
    settled_control,
    wait_for,
)


def nack(producer: Producer, control: str, topic: str, offset: int, delay_ms: int) -> None:
    command = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0,
               "offset": offset, "delay_ms": delay_ms, "redelivery_count": 0}  # fmt: skip
    producer.produce(control, json.dumps(command).encode(), key=f"{topic}/0/{offset}".encode())


def test_an_accepted_nack_survives_kill_9_without_local_state_and_comes_back_once(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, control = topic_factory("durable"), f"ctl-{uuid.uuid4().hex[:8]}"
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{billing: {{}}}}\n")
    port, group = free_port(), f"g-{topic}"
    args = ["--bootstrap-servers", kafka, "--policies", str(policies), "--state-dir", str(tmp_path / "state"),
            "--metrics-port", str(port), "--group-id", group, "--commit-interval-ms", "200",
            "--control-topic", control, "--tracker", "memory"]  # fmt: skip
    sidecar = SidecarProcess(args, tmp_path / "log")
    # A record pending for the whole test, before everything else: each restart rebuilds the
    # index from its offset, reading the nacked records again while the nacks are replayed.
    kafka_helper.produce(topic, b"pending", headers=[("deliver-after", "10m")])
    for i in range(5_000):
        kafka_helper.produce(topic, f"v{i}".encode())
    kafka_helper.flush()
    nacked = range(4_980, 5_001)
    try:
        sidecar.start()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.billing") == 5_000, 60, "first deliveries")
        producer = Producer({"bootstrap.servers": kafka})
        for offset in nacked:
            nack(producer, control, topic, offset, 6_000)
        assert producer.flush(10) == 0
        # Each command and its acceptance committed: the next offset is past both.
        wait_for(lambda: settled_control(kafka, kafka_helper, group, control, len(nacked)), 30, "the nacks accepted")
        sidecar.kill()
        sidecar.start()  # the in-memory index is gone: the accepted nacks must come back from Kafka
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.billing") >= 5_000 + len(nacked), 60, "redeliveries")
        wait_for(lambda: scrape(port, "delay_sidecar_redeliveries_total", subscription="billing") == len(nacked),
                 30, "the redeliveries counted")  # fmt: skip

        # Nothing pending on the control partitions any more: the watermark covers every nack.
        def settled() -> bool:
            return all(meta is None or json.loads(meta)["earliest"] == offset
                       for offset, meta in committed(kafka, group, control, 3) if offset > 0)  # fmt: skip

        wait_for(settled, 30, "a commit after the redeliveries")
        sidecar.kill()
        sidecar.start()  # the redeliveries are covered by the control partition's watermark
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 1, 30, "serving again")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    records = kafka_helper.read_to_end(f"{topic}.billing")
    copies = deliveries(records)
    again = {(p, o): n for (p, o, count), n in copies.items() if count == 1}
    assert again == {(0, o): 1 for o in nacked}, sidecar.tail()
    assert all(n == 1 for n in copies.values()) and not early(records)
    assert kafka_helper.read_to_end(f"{control}.dlt") == []
    redelivered = [r for r in records if r.headers[REDELIVERY_COUNT] == b"1"]
    assert {int(r.headers[ORIGIN_OFFSET]) for r in redelivered} == set(nacked)
    assert {r.headers[ORIGIN_PARTITION] for r in redelivered} == {b"0"}
