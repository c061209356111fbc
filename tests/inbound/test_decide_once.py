"""A record's fate is decided once, at first intake: a rebuild after a lost state dir judges it
with the rule recorded in the commit, not with a policy edited since."""

import shutil
import signal
from pathlib import Path

from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from sidecar.broker.ports import free_port
from sidecar.outbound.records import DELIVER_AT, ERROR_CODE, ORIGIN_OFFSET
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
    start_serving,
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
    try:
        start_serving(sidecar, port)  # the delays count from the publish: none may pass before intake
        for i in range(100):
            kafka_helper.produce(max_topic, f"m{i}".encode(), headers=[("deliver-after", "10s")])
            kafka_helper.produce(fixed_topic, f"f{i}".encode())
        kafka_helper.produce(kept_topic, b"accepted", headers=[("deliver-after", "12s")])
        kafka_helper.produce(kept_topic, b"beyond retention", headers=[("deliver-after", "30s")])
        kafka_helper.flush()

        def committed_to_end(topic: str) -> bool:
            return committed(kafka, f"g-{max_topic}", topic, 1)[0][0] == kafka_helper.end_offsets(topic)[0]

        for topic, n in ((max_topic, 100), (fixed_topic, 100), (kept_topic, 1)):
            wait_for(lambda t=topic, n=n: scrape(port, "delay_sidecar_tracked_messages", topic=t) == n, 60, "indexed")
            # The gauge is set before the commit (it waits for the fsync): records not in it would be judged anew.
            wait_for(lambda t=topic: committed_to_end(t), 60, f"{topic}'s rules in the commit")
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


def test_every_rule_of_a_long_history_survives_a_lost_state_dir(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """12 fixed-delay changes with 10 long subscription names: about 6 KB of rules, past what Kafka's
    commit metadata holds. Before, the oldest rules were dropped and a rebuild judged their records
    with a later rule; now the whole history is in the state topic and each record keeps its own."""
    topic, changes = topic_factory("history"), 12
    subs = [f"subscription-with-a-rather-long-name-number-{k:02d}" for k in range(10)]
    names = ", ".join(f"{s}: {{}}" for s in subs)

    def policy(fixed_ms: int) -> str:
        return f"topics:\n  {topic}:\n    delayed_delivery: {{fixed_delivery_delay: {fixed_ms}ms}}\n" \
               f"    subscriptions: {{{names}}}\n"  # fmt: skip

    fixed = [25_000 + 500 * i for i in range(changes)]  # every record still pending at the kill
    path = policy_file(policy(fixed[0]))
    port, state = free_port(), tmp_path / "state"
    args = ["--bootstrap-servers", kafka, "--policies", str(path), "--state-dir", str(state),
            "--metrics-port", str(port), "--group-id", f"g-{topic}", "--commit-interval-ms", "200"]  # fmt: skip
    sidecar = SidecarProcess(args, tmp_path / "log")
    try:
        sidecar.start()
        for i, fixed_ms in enumerate(fixed):
            if i:
                path.write_text(policy(fixed_ms))
                assert sidecar.process is not None
                sidecar.process.send_signal(signal.SIGHUP)
            wait_for(lambda i=i: scrape(port, "delay_sidecar_policy_generation") == i + 1, 120, f"rule {i}")
            kafka_helper.produce(topic, f"r{i}".encode())
            kafka_helper.flush()
            wait_for(
                lambda i=i: scrape(port, "delay_sidecar_messages_delayed_total", topic=topic) == i + 1, 120, "intake"
            )
        wait_for(lambda: "rule history written to the state topic" in sidecar.log.read_text(), 30, "the history")
        sidecar.kill()
        shutil.rmtree(state)  # the index and everything local are gone
        sidecar.start()
        for sub in (subs[0], subs[-1]):
            wait_for(lambda s=sub: outbound_end(kafka_helper, f"{topic}.{s}") >= changes, 60, f"{sub} delivered")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    published = {r.offset: r.timestamp for r in kafka_helper.read_to_end(topic)}
    for sub in (subs[0], subs[-1]):
        records = kafka_helper.read_to_end(f"{topic}.{sub}")
        assert sorted(deliveries(records).values()) == [1] * changes and not early(records), sub
        got = {int(r.headers[ORIGIN_OFFSET]): r.header_int(DELIVER_AT) - published[int(r.headers[ORIGIN_OFFSET])]
               for r in records}  # fmt: skip
        assert got == dict(enumerate(fixed)), sub  # record i was taken in under rule i
