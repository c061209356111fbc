"""A control topic per topic (policy `control_topic`), against a real broker: commands are taken only on
the topic's own control topic, answered there, and a control topic the policies drop is read until its
accepted nacks are out, across kill -9."""

import json
import time
import uuid
from collections import Counter
from pathlib import Path

from confluent_kafka import Producer

from sidecar.broker.ports import free_port
from sidecar.outbound.records import ERROR_CODE, ORIGIN_OFFSET, REDELIVERY_COUNT
from sidecar.partitions.metadata import CommitMetadata
from tests.control.test_cancel import by_offset, command, outcomes
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    ThreadedSidecar,
    TopicFactory,
    committed,
    early,
    run_args,
    scrape,
    settings_for,
    settled_control,
    wait_for,
)


def nack(producer: Producer, control: str, topic: str, offset: int, delay_ms: int, id_: str = "") -> None:
    body = {"type": "nack", "subscription": "billing", "topic": topic, "partition": 0, "offset": offset}
    command(producer, control, {**body, "delay_ms": delay_ms, **({"id": id_} if id_ else {})})


def test_each_topic_takes_commands_only_on_its_own_control_topic(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    own, shared = topic_factory("own"), topic_factory("shared")
    default, own_control = f"ctl-{uuid.uuid4().hex[:8]}", f"{own}.control"
    policies = policy_file(f"""
topics:
  {own}:
    control_topic: {own_control}
    subscriptions: {{billing: {{}}}}
  {shared}:
    subscriptions: {{billing: {{}}}}
""")
    settings = settings_for(kafka, policies, tmp_path, control_topic=default)
    producer = Producer({"bootstrap.servers": kafka})
    with ThreadedSidecar(settings) as sidecar:
        due = int(time.time() * 1000) + 8_000  # serving: the cancels are judged before it however slow the start
        for topic in (own, shared):
            for i in range(2):
                kafka_helper.produce(topic, f"{topic}-{i}".encode(), headers=[("deliver-at", str(due))])
            kafka_helper.produce(topic, f"{topic}-now".encode())  # offset 2: delivered at once, then nacked
        kafka_helper.flush()
        for topic in (own, shared):
            sidecar.wait_for_metric("delay_sidecar_messages_delivered_total", topic=topic, subscription="billing")
        cancel = {"type": "cancel", "partition": 0, "offset": 0}
        command(producer, default, {**cancel, "topic": own, "id": "own-on-default"})
        command(producer, own_control, {**cancel, "topic": shared, "id": "shared-on-own"})
        command(producer, own_control, {**cancel, "topic": own, "id": "own-on-own"})
        command(producer, default, {**cancel, "topic": shared, "offset": 1, "id": "shared-on-default"})
        nack(producer, default, own, 2, 1_000)  # refused: the own topic's commands go to its control topic
        nack(producer, own_control, own, 2, 1_000)
        nack(producer, own_control, shared, 2, 1_000)  # refused
        nack(producer, default, shared, 2, 1_000)
        producer.flush(10)
        wait_for(lambda: len(outcomes(kafka_helper, default)) == 2 and len(outcomes(kafka_helper, own_control)) == 2,
                 30, "two outcomes on each outcomes topic")  # fmt: skip
        for topic in (own, shared):  # 2 delayed records, one of them cancelled, and 2 nack deliveries
            sidecar.wait_for_metric("delay_sidecar_messages_delivered_total", 3, topic=topic, subscription="billing")
        time.sleep(1.0)  # anything extra would come now
    on_default, on_own = outcomes(kafka_helper, default), outcomes(kafka_helper, own_control)
    assert {k: [(o["outcome"], o.get("code")) for o in v] for k, v in on_default.items()} == {
        "own-on-default": [("rejected", "WRONG_CONTROL_TOPIC")],
        "shared-on-default": [("cancelled", None)],
    }
    assert {k: [(o["outcome"], o.get("code")) for o in v] for k, v in on_own.items()} == {
        "shared-on-own": [("rejected", "WRONG_CONTROL_TOPIC")],
        "own-on-own": [("cancelled", None)],
    }
    assert on_own["own-on-own"][0]["command"]["topic"] == own_control
    for control, topic in ((default, own), (own_control, shared)):
        dead = kafka_helper.read_to_end(f"{control}.dlt")
        assert [(r.headers[ERROR_CODE], json.loads(r.value or b"")["topic"]) for r in dead] == [
            (b"WRONG_CONTROL_TOPIC", topic)
        ]
    own_out, shared_out = kafka_helper.read_to_end(f"{own}.billing"), kafka_helper.read_to_end(f"{shared}.billing")
    assert by_offset(own_out) == Counter({1: 1, 2: 2}) and by_offset(shared_out) == Counter({0: 1, 2: 2})
    for records in (own_out, shared_out):
        assert Counter(r.headers[REDELIVERY_COUNT] for r in records if int(r.headers[ORIGIN_OFFSET]) == 2) == {
            b"0": 1,
            b"1": 1,
        }
        assert not early(records)


def test_a_control_topic_the_policies_drop_is_read_until_its_nacks_are_out(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """Nacks accepted on a topic's own control topic, the sidecar killed, the policies changed while it is
    down so that the topic goes back to the default control topic: the old one is still read, each nack
    comes back once, and a new command on the old control topic is refused."""
    topic, default = topic_factory("retire"), f"ctl-{uuid.uuid4().hex[:8]}"
    old_control, group, port = f"{topic}.control", f"g-{default}", free_port()

    def write(control_line: str) -> Path:
        return policy_file(f"topics:\n  {topic}:\n{control_line}    subscriptions: {{billing: {{}}}}\n")

    policies = write(f"    control_topic: {old_control}\n")
    args = run_args(kafka, policies, tmp_path / "state", port, group, "--control-topic", default)
    sidecar = SidecarProcess(args, tmp_path / "sidecar.log")
    try:
        sidecar.start()
        for i in range(20):
            kafka_helper.produce(topic, f"v{i}".encode())
        kafka_helper.flush()
        assert len(kafka_helper.read(f"{topic}.billing", 20, timeout_s=30)) == 20, sidecar.tail()
        producer = Producer({"bootstrap.servers": kafka})
        for offset in range(20):
            nack(producer, old_control, topic, offset, 8_000)
        producer.flush(10)

        def pending_commits() -> bool:
            commits = committed(kafka, group, old_control, 3)
            judged = settled_control(kafka, kafka_helper, group, old_control, 20)  # each command, each acceptance
            pending = [
                CommitMetadata.decode(m) for o, m in commits if CommitMetadata.decode(m).earliest not in (None, o)
            ]
            return judged and bool(pending) and all(m.control for m in pending)

        wait_for(pending_commits, 30, "the nacks accepted and committed")
        sidecar.kill()
        write("")  # the topic's commands go to the default control topic from now on
        sidecar.start()
        wait_for(lambda: scrape(port, "delay_sidecar_redeliveries_total", subscription="billing") >= 20, 60,
                 "the redeliveries")  # fmt: skip
        nack(producer, old_control, topic, 0, 1_000, "late")
        nack(producer, default, topic, 1, 1_000)
        producer.flush(10)
        wait_for(lambda: scrape(port, "delay_sidecar_redeliveries_total", subscription="billing") >= 21, 60,
                 "the nack on the default control topic")  # fmt: skip
        wait_for(lambda: len(kafka_helper.read_to_end(f"{old_control}.dlt")) == 1, 30, "the refused nack")
        time.sleep(1.0)  # anything extra would come now
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    records = kafka_helper.read_to_end(f"{topic}.billing")
    again = Counter(int(r.headers[ORIGIN_OFFSET]) for r in records if r.headers[REDELIVERY_COUNT] == b"1")
    assert again == Counter({**dict.fromkeys(range(20), 1), 1: 2}), again
    assert not early(records)
    [refused] = kafka_helper.read_to_end(f"{old_control}.dlt")
    assert refused.headers[ERROR_CODE] == b"WRONG_CONTROL_TOPIC"


def test_a_control_topic_added_by_a_live_policy_edit_is_served_at_once(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """No restart: the new control topic is created, subscribed and judged, and the default one refuses."""
    topic, default = topic_factory("livectl"), f"ctl-{uuid.uuid4().hex[:8]}"
    own = f"{topic}.control"
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{billing: {{}}}}\n")
    producer = Producer({"bootstrap.servers": kafka})
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path, control_topic=default)) as sidecar:
        kafka_helper.produce(topic, b"v0")
        kafka_helper.flush()
        assert len(kafka_helper.read(f"{topic}.billing", 1)) == 1
        policies.write_text(f"topics:\n  {topic}:\n    control_topic: {own}\n    subscriptions: {{billing: {{}}}}\n")
        assert sidecar.wait_for_metric("delay_sidecar_policy_generation", at_least=2) == 2
        nack(producer, default, topic, 0, 500)
        nack(producer, own, topic, 0, 500)
        producer.flush(10)
        sidecar.wait_for_metric("delay_sidecar_redeliveries_total", subscription="billing")
        assert [r.headers[ERROR_CODE] for r in kafka_helper.read(f"{default}.dlt", 1)] == [b"WRONG_CONTROL_TOPIC"]
        time.sleep(1.0)  # anything extra would come now
    records = kafka_helper.read_to_end(f"{topic}.billing")
    assert Counter(r.headers.get(REDELIVERY_COUNT, b"0") for r in records) == {b"0": 1, b"1": 1}
