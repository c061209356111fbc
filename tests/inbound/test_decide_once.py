"""A record's fate is decided once, at first intake: a rebuild after a lost state dir judges it
with the rule recorded in the commit, not with a policy edited since."""

import shutil
from pathlib import Path

from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from sidecar.broker.embedded import free_port
from sidecar.outbound.records import DELIVER_AT, ERROR_CODE, ORIGIN_OFFSET
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    TopicFactory,
    deliveries,
    early,
    outbound_end,
    scrape,
    wait_for,
)


def policies(max_topic: str, fixed_topic: str, kept_topic: str, max_delay: str, fixed: str) -> str:
    return f"""
topics:
  {max_topic}:
    delayed_delivery: {{max_delivery_delay: {max_delay}}}
    subscriptions: {{a: {{}}}}
  {fixed_topic}:
    delayed_delivery: {{fixed_delivery_delay: {fixed}}}
    subscriptions: {{a: {{}}}}
  {kept_topic}:
    subscriptions: {{a: {{}}}}
"""


def test_a_policy_change_after_a_lost_state_dir_applies_only_to_new_records(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    max_topic, fixed_topic = topic_factory("max"), topic_factory("fixed")
    kept_topic = topic_factory("kept", config={"retention.ms": "20000"})
    path = policy_file(policies(max_topic, fixed_topic, kept_topic, "60s", "10s"))
    port, state = free_port(), tmp_path / "state"
    args = ["--bootstrap-servers", kafka, "--policies", str(path), "--state-dir", str(state),
            "--metrics-port", str(port), "--group-id", f"g-{max_topic}", "--commit-interval-ms", "200"]  # fmt: skip
    sidecar = SidecarProcess(args, tmp_path / "log")
    for i in range(100):
        kafka_helper.produce(max_topic, f"m{i}".encode(), headers=[("deliver-after", "10s")])
        kafka_helper.produce(fixed_topic, f"f{i}".encode())
    kafka_helper.produce(kept_topic, b"accepted", headers=[("deliver-after", "12s")])
    kafka_helper.produce(kept_topic, b"beyond retention", headers=[("deliver-after", "30s")])
    kafka_helper.flush()
    try:
        sidecar.start()
        for topic, n in ((max_topic, 100), (fixed_topic, 100), (kept_topic, 1)):
            wait_for(lambda t=topic, n=n: scrape(port, "delay_sidecar_tracked_messages", topic=t) == n, 60, "indexed")
        sidecar.kill()
        shutil.rmtree(state)  # the index is gone: it is rebuilt from the inbound log
        path.write_text(policies(max_topic, fixed_topic, kept_topic, "2s", "1s"))
        retention = ConfigEntry("retention.ms", "86400000", incremental_operation=AlterConfigOpType.SET)
        config = ConfigResource("topic", kept_topic, incremental_configs=[retention])
        admin = AdminClient({"bootstrap.servers": kafka})
        admin.incremental_alter_configs([config])[config].result(10)
        sidecar.start()
        for topic, n in ((max_topic, 100), (fixed_topic, 100), (kept_topic, 1)):
            wait_for(lambda t=topic, n=n: outbound_end(kafka_helper, f"{t}.a") >= n, 60, f"{topic} delivered")
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=kept_topic) == 0, 30, "a checkpoint")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    for topic, n in ((max_topic, 100), (fixed_topic, 100), (kept_topic, 1)):
        records = kafka_helper.read_to_end(f"{topic}.a")
        assert sorted(deliveries(records).values()) == [1] * n, topic
        assert not early(records)
    # The fixed delay in force at intake (10 s), not the one edited in since (1 s).
    published = {r.offset: r.timestamp for r in kafka_helper.read_to_end(fixed_topic)}
    for r in kafka_helper.read_to_end(f"{fixed_topic}.a"):
        assert r.header_int(DELIVER_AT) == published[int(r.headers[ORIGIN_OFFSET])] + 10_000
    assert kafka_helper.read_to_end(f"{max_topic}.dlt") == []
    [rejected] = kafka_helper.read_to_end(f"{kept_topic}.dlt")
    assert rejected.value == b"beyond retention" and rejected.headers[ERROR_CODE] == b"EXCEEDS_RETENTION"
    assert [r.value for r in kafka_helper.read_to_end(f"{kept_topic}.a")] == [b"accepted"]
