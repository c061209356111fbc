"""The metrics port: /metrics, /healthz and /policies/{topic} (contract section 7)."""

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from sidecar.broker.ports import free_port
from tests.kafka_helpers import KafkaHelper, ThreadedSidecar, settings_for


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_health_and_policies(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    topic = topic_factory("http")
    policies = policy_file(
        f"topics:\n  {topic}:\n    delayed_delivery: {{max_delivery_delay: 1h}}\n    subscriptions: {{a: {{}}}}\n"
    )
    port = free_port()
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path, metrics_port=port)):
        kafka_helper.produce(topic, b"v")
        kafka_helper.flush()
        assert len(kafka_helper.read(f"{topic}.a", 1)) == 1
        status, health = get(port, "/healthz")
        assert status == 200 and json.loads(health)["status"] == "ready"
        status, metrics = get(port, "/metrics")
        assert status == 200
        assert f'delay_sidecar_messages_in_total{{topic="{topic}"}} 1.0' in metrics
        assert f'delay_sidecar_messages_delivered_total{{subscription="a",topic="{topic}"}} 1.0' in metrics
        status, policy = get(port, f"/policies/{topic}")
        body = json.loads(policy)
        assert status == 200
        assert body["delayed_delivery"]["max_delivery_delay_ms"] == {"value": 3_600_000, "source": "topic"}
        assert get(port, "/nothing")[0] == 404
