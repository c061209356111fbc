"""Policies enforced by the running sidecar against a real broker (PIP-315, PIP-437, live reload)."""

import json
import time
import urllib.request
from pathlib import Path

from sidecar.broker.ports import free_port
from sidecar.outbound.records import DELIVER_AT, ERROR_CODE, ERROR_MESSAGE, ORIGIN_OFFSET, ORIGIN_TOPIC
from tests.kafka_helpers import KafkaHelper, PolicyFile, ThreadedSidecar, TopicFactory, settings_for


def test_over_max_delay_is_dead_lettered_with_code_message_and_origin(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic = topic_factory("max")
    policies = policy_file(f"""
topics:
  {topic}:
    delayed_delivery: {{max_delivery_delay: 1m}}
    subscriptions: {{a: {{}}}}
""")
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path)) as sidecar:
        kafka_helper.produce(topic, b"late", headers=[("deliver-after", "90s")])
        kafka_helper.produce(topic, b"ok", headers=[("deliver-after", "1s")])
        kafka_helper.flush()
        [dead] = kafka_helper.read(f"{topic}.dlt", 1, extra_s=0.5)
        assert dead.value == b"late"
        assert dead.headers[ERROR_CODE] == b"EXCEEDS_MAX_DELAY"
        assert b"by 30s" in dead.headers[ERROR_MESSAGE] and b"1m" in dead.headers[ERROR_MESSAGE]
        assert (dead.headers[ORIGIN_TOPIC], dead.headers[ORIGIN_OFFSET]) == (topic.encode(), b"0")
        assert [r.value for r in kafka_helper.read(f"{topic}.a", 1, extra_s=0.5)] == [b"ok"]
        assert (
            sidecar.metric(
                "delay_sidecar_messages_delayed_rejected_total", topic=topic, namespace="", code="EXCEEDS_MAX_DELAY"
            )
            == 1
        )


def test_fixed_delay_overrides_the_header_and_counts_it(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic = topic_factory("fixed")
    policies = policy_file(f"""
namespaces:
  fx:
    topics: "{topic}"
    delayed_delivery: {{max_delivery_delay: 1s}}
topics:
  {topic}:
    delayed_delivery: {{fixed_delivery_delay: 2s}}
    subscriptions: {{a: {{}}}}
""")
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path)) as sidecar:
        published = int(time.time() * 1000)
        kafka_helper.produce(topic, b"h", headers=[("deliver-after", "1h")], timestamp=published)  # fixed wins over max
        kafka_helper.produce(topic, b"n", timestamp=published)
        kafka_helper.flush()
        records = kafka_helper.read(f"{topic}.a", 2, timeout_s=60)
        assert sorted(r.value for r in records) == [b"h", b"n"]
        for r in records:
            assert r.header_int(DELIVER_AT) == published + 2000
            assert r.timestamp >= published + 2000
        assert sidecar.metric("delay_sidecar_messages_fixed_delay_overridden_total", topic=topic, namespace="fx") == 1


def test_exclusive_subscription_gets_the_record_at_once_while_shared_waits(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic = topic_factory("excl")
    policies = policy_file(f"""
topics:
  {topic}:
    subscriptions:
      shared: {{}}
      archive: {{type: exclusive}}
""")
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path)):
        published = int(time.time() * 1000)
        for i in range(5):  # 7-8 s: not due yet when a busy machine's intake reads them
            kafka_helper.produce(
                topic, f"{i}".encode(), headers=[("deliver-after", f"{8 - i % 2}s")], timestamp=published + i
            )
        kafka_helper.flush()
        archive = kafka_helper.read(f"{topic}.archive", 5)
        assert [r.value for r in archive] == [b"0", b"1", b"2", b"3", b"4"]  # inbound order
        assert [r.header_int(DELIVER_AT) for r in archive] == [published + i for i in range(5)]  # no delay
        shared = kafka_helper.read(f"{topic}.shared", 5, timeout_s=60)
        assert [r.value for r in shared] == [b"1", b"3", b"0", b"2", b"4"]  # deliver-at order
        assert all(r.timestamp >= r.header_int(DELIVER_AT) for r in shared)


def test_retention_shorter_than_the_delay_is_refused_loudly(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic = topic_factory("ret", config={"retention.ms": "60000"})
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path)):
        kafka_helper.produce(topic, b"x", headers=[("deliver-after", "2m")])
        kafka_helper.flush()
        [dead] = kafka_helper.read(f"{topic}.dlt", 1)
        assert dead.headers[ERROR_CODE] == b"EXCEEDS_RETENTION"
        assert b"retention.ms=60000" in dead.headers[ERROR_MESSAGE]


def test_live_edit_changes_behaviour_and_a_broken_edit_keeps_the_old_policy(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, added = topic_factory("live"), topic_factory("added")
    port = free_port()
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}, gone: {{}}}}\n")
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path, metrics_port=port)) as sidecar:
        kafka_helper.produce(topic, b"before", headers=[("deliver-after", "1h")])
        kafka_helper.flush()
        assert sidecar.app.sidecar is not None
        sidecar.wait_for_metric("delay_sidecar_messages_delayed_total", topic=topic)

        # Edit: a max delay, a new subscription, one removed, and a whole new topic. No restart.
        policies.write_text(f"""
topics:
  {topic}:
    delayed_delivery: {{max_delivery_delay: 10m}}
    subscriptions: {{a: {{}}, b: {{}}}}
  {added}:
    subscriptions: {{c: {{}}}}
""")
        # The generation in force is the one the engine applied (its gauge), not merely the one loaded.
        assert sidecar.wait_for_metric("delay_sidecar_policy_generation", at_least=2) == 2
        kafka_helper.produce(topic, b"too-late", headers=[("deliver-after", "1h")])
        kafka_helper.produce(topic, b"now")
        kafka_helper.produce(added, b"new-topic")
        kafka_helper.flush()
        assert [r.value for r in kafka_helper.read(f"{topic}.dlt", 1)] == [b"too-late"]
        assert [r.value for r in kafka_helper.read(f"{topic}.b", 1, extra_s=0.5)] == [b"now"]
        assert [r.value for r in kafka_helper.read(f"{added}.c", 1, timeout_s=60)] == [b"new-topic"]
        assert [r.value for r in kafka_helper.read(f"{topic}.gone", 0, extra_s=0.5)] == []

        # A broken edit: reported (log, /healthz, metric), and generation 2 keeps working.
        policies.write_text(f"topics:\n  {topic}:\n    delayed_delivery: {{max_delivery_delay: soon}}\n")
        assert sidecar.wait_for_metric("delay_sidecar_policy_reloads_total", result="error") == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            health = json.loads(response.read())
        assert health["status"] == "ready"
        assert "max_delivery_delay" in health["details"]["policy_error"]
        assert health["details"]["policy_generation"] == 2
        kafka_helper.produce(topic, b"still-limited", headers=[("deliver-after", "1h")])
        kafka_helper.flush()
        assert [r.value for r in kafka_helper.read(f"{topic}.dlt", 2)][-1] == b"still-limited"


def test_an_empty_save_is_refused_and_the_topic_is_still_served(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """Issue 12: a file saved as truncate-then-write, caught empty, unsubscribed the topic silently."""
    topic = topic_factory("empty")
    port = free_port()
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path, metrics_port=port)) as sidecar:
        policies.write_text("")  # and the rest of the save never comes
        assert sidecar.wait_for_metric("delay_sidecar_policy_reloads_total", result="error") == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            health = json.loads(response.read())
        assert health["details"]["policy_generation"] == 1
        assert "allow_empty: true" in health["details"]["policy_error"]
        assert sidecar.metric("delay_sidecar_policy_generation") == 1
        kafka_helper.produce(topic, b"still-served")
        kafka_helper.flush()
        assert [r.value for r in kafka_helper.read(f"{topic}.a", 1, extra_s=0.5)] == [b"still-served"]
