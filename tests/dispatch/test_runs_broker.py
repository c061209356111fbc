"""Monotone runs inside the running sidecar, against a real broker.

Records whose deliver-at rises with the offset are delivered by reading the log again in order
(`payload_reads_total{source="run"}`), not through the index and the payload cache. Every test
reads the outbound topic to its end and counts copies per record: a loss, a duplicate or an early
delivery fails it, whatever path the records took.
"""

import time
from pathlib import Path

import pytest

from sidecar.broker.ports import free_port
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    TopicFactory,
    assert_once_each,
    deliveries,
    early,
    outbound_end,
    run_args,
    scrape,
    start_serving,
    wait_for,
)

COUNT = 3_000
FIXED_MS = 4_000
RUNS = "--monotone-runs"


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


def run_reads(port: int, topic: str) -> float:
    return scrape(port, "delay_sidecar_payload_reads_total", topic=topic, source="run")


def indexed(port: int, topic: str) -> float:
    """Records that were not due yet when intake read them (run members count too). One already due
    goes out at once, outside any run: a slow start of the process on a busy machine makes a few."""
    return scrape(port, "delay_sidecar_messages_delayed_total", topic=topic)


@pytest.mark.parametrize("flag", [RUNS, "--no-monotone-runs"])
def test_a_fixed_delay_topic_is_delivered_from_runs(
    flag: str,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
) -> None:
    """With --monotone-runs every record comes from a run; without, none does (the index and the cache)."""
    topic = topic_factory("run")
    port = free_port()
    sidecar = SidecarProcess(
        run_args(kafka, fixed_policies(policy_file, topic), tmp_path / "state", port, f"g-{topic}", flag),
        tmp_path / "log",
    )
    try:
        start_serving(sidecar, port)
        now = int(time.time() * 1000)
        produce_stamped(kafka_helper, topic, [now + i // 3 for i in range(COUNT)])  # 1,000 ms of records
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= COUNT, 60, "every record delivered")
        assert indexed(port, topic) > COUNT // 2  # most were not due at intake: the test says something
        expected = indexed(port, topic) if flag == RUNS else 0
        wait_for(lambda: run_reads(port, topic) == expected, 10, f"{expected} records read from runs")
        assert scrape(port, "delay_sidecar_payload_reads_total", topic=topic, source="cache") == 0
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", COUNT)


def test_a_producer_clock_that_jumps_back_and_forth_loses_nothing_and_is_never_early(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic = topic_factory("skew")
    port = free_port()
    sidecar = SidecarProcess(
        run_args(kafka, fixed_policies(policy_file, topic), tmp_path / "state", port, f"g-{topic}", RUNS),
        tmp_path / "log",
    )
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
        assert run_reads(port, topic) > 0  # runs were formed, around the jumps
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", len(stamps))


def test_a_run_interrupted_by_a_longer_delay(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """deliver-at headers rising with the offset, and one record asking for much longer: it is indexed
    and comes at its own time; the records after it stay in the run."""
    topic = topic_factory("long")
    port = free_port()
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    sidecar = SidecarProcess(run_args(kafka, policies, tmp_path / "state", port, f"g-{topic}", RUNS), tmp_path / "log")
    try:
        start_serving(sidecar, port)
        base = int(time.time() * 1000) + 3_000
        at = [base + i for i in range(COUNT)]
        at[COUNT // 2] = base + 8_000
        for i, deliver_at in enumerate(at):
            kafka_helper.produce(topic, f"v{i}".encode(), headers=[("deliver-at", str(deliver_at))])
        kafka_helper.flush()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= COUNT, 60, "every record delivered")
        # All that were not due at intake but the long one: records due already when read go out at
        # once, and the run opens after them (the CI of stop 28 had 150 of them, before start_serving).
        assert indexed(port, topic) > COUNT // 2 + 1
        assert run_reads(port, topic) == indexed(port, topic) - 1
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    records = kafka_helper.read_to_end(f"{topic}.a")
    assert_once_each(kafka_helper, f"{topic}.a", COUNT)
    late_one = next(r for r in records if int(r.headers["delay-origin-offset"]) == COUNT // 2)
    assert late_one.timestamp >= base + 8_000


def test_runs_survive_kill_9_and_a_clean_restart(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """Killed while runs are pending, then started on the same state dir: nothing lost or early (a
    kill may repeat what was sent since the last checkpoint); a clean stop and start repeats nothing."""
    topic = topic_factory("runkill", partitions=2)
    port = free_port()
    args = run_args(kafka, fixed_policies(policy_file, topic), tmp_path / "state", port, f"g-{topic}", RUNS)
    sidecar = SidecarProcess(args, tmp_path / "log")
    now = int(time.time() * 1000)
    stamps = [now + i for i in range(COUNT)]  # due over 3 s, from FIXED_MS on
    try:
        sidecar.start()
        for i, stamp in enumerate(stamps):
            kafka_helper.produce(topic, f"v{i}".encode(), partition=i % 2, timestamp=stamp)
        kafka_helper.flush()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) > 0, 60, "the first deliveries")
        sidecar.kill()
        killed_at = outbound_end(kafka_helper, f"{topic}.a", 2)
        start_serving(sidecar, port)  # may all be out already: a stop before the signal handler is -15
        # Copies from before the kill count towards the end offset: wait for every record instead.
        delivered = lambda: len(deliveries(kafka_helper.read_to_end(f"{topic}.a"))) == COUNT  # noqa: E731
        wait_for(delivered, 60, "every record delivered")
        assert sidecar.stop() == 0, sidecar.tail()
        records = kafka_helper.read_to_end(f"{topic}.a")
        copies = deliveries(records)
        missing = sorted({(i % 2, i // 2) for i in range(COUNT)} - {(p, o) for p, o, _ in copies})
        assert len(copies) == COUNT, f"{len(missing)} lost (killed after {killed_at} deliveries): {missing[:60]}"
        assert not early(records)
        stopped_at = len(records)
        sidecar.start()  # a clean restart: nothing more
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 0, 60, "serving again")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert outbound_end(kafka_helper, f"{topic}.a", 2) == stopped_at
