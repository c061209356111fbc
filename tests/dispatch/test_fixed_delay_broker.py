"""Fixed delays inside the running sidecar, against a real broker: a fixed delay counts from the
producer's timestamp, whatever that clock does. The test reads the outbound topic to its end and
counts copies per record: a loss, a duplicate or an early delivery fails it.
"""

import time
from pathlib import Path

from sidecar.broker.ports import free_port
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    TopicFactory,
    assert_once_each,
    outbound_end,
    run_args,
    start_serving,
    wait_for,
)

FIXED_MS = 4_000


def fixed_policies(policy_file: PolicyFile, topic: str) -> Path:
    return policy_file(
        f"topics:\n  {topic}:\n    delayed_delivery:\n      fixed_delivery_delay: {FIXED_MS}ms\n"
        "    subscriptions: {a: {}}\n"
    )


def produce_stamped(kafka_helper: KafkaHelper, topic: str, stamps: list[int]) -> None:
    """Records with the given producer timestamps (a fixed delay counts from them)."""
    for i, stamp in enumerate(stamps):
        kafka_helper.produce(topic, f"v{i}".encode(), timestamp=stamp)
    kafka_helper.flush()


def test_a_producer_clock_that_jumps_back_and_forth_loses_nothing_and_is_never_early(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """With an operator's command line from before monotone runs were removed: the flag is ignored
    with a warning, and every record goes through the index."""
    topic = topic_factory("skew")
    port = free_port()
    args = run_args(kafka, fixed_policies(policy_file, topic), tmp_path / "state", port, f"g-{topic}")
    sidecar = SidecarProcess([*args, "--monotone-runs"], tmp_path / "log")
    try:
        start_serving(sidecar, port)
        now = int(time.time() * 1000)  # once serving: a slow start does not eat the fixed delay
        stamps = [now + i for i in range(800)]
        stamps += [now + 300 + i for i in range(400)]  # the clock steps back 500 ms
        stamps += [now + 3_000 + i for i in range(600)]  # then forwards 2.3 s
        stamps += [now + 1_000 + i % 50 for i in range(400)]  # then back again, and jittery
        stamps += [now + 4_000 + i for i in range(800)]
        produce_stamped(kafka_helper, topic, stamps)
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= len(stamps), 60, "every record delivered")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert "--monotone-runs is ignored" in (tmp_path / "log").read_text()
    assert_once_each(kafka_helper, f"{topic}.a", len(stamps))
