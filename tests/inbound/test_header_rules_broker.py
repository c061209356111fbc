"""The delay-header rules a user trips over, through the running sidecar and a real broker."""

import time
from pathlib import Path

from sidecar.outbound.records import DELIVER_AT
from tests.kafka_helpers import KafkaHelper, PolicyFile, ThreadedSidecar, TopicFactory, settings_for


def test_every_past_deliver_at_goes_out_at_once_stamped_with_the_publish_time(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """Issue 12: deliver-at 0 came out as delay-deliver-at = publish time, deliver-at 1000 as 1000."""
    topic = topic_factory("past")
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    published = int(time.time() * 1000)
    sent = {
        b"zero": [("deliver-at", b"0")],
        b"thousand": [("deliver-at", b"1000")],
        b"an-hour-ago": [("deliver-at", str(published - 3_600_000).encode())],
        b"after-zero": [("deliver-after", b"0")],
        b"none": [],
        b"miscased": [("Deliver-At", str(published + 3_600_000).encode())],  # not a delay header: at once
    }
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path)) as sidecar:
        for value, headers in sent.items():
            kafka_helper.produce(topic, value, headers=headers, timestamp=published)
        kafka_helper.flush()
        records = kafka_helper.read(f"{topic}.a", len(sent), timeout_s=60)
        assert sidecar.wait_for_metric("delay_sidecar_delay_header_miscased_total", topic=topic) == 1
    assert {r.value: r.header_int(DELIVER_AT) for r in records} == dict.fromkeys(sent, published)
