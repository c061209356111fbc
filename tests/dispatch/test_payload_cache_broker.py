"""The payload cache inside the running sidecar, against a real broker.

Where each payload came from is read off `payload_reads_total{topic,source}`; every test also reads
the outbound topic to its end and counts copies per record, so a loss, a duplicate or an early
delivery fails it whatever the cache did.
"""

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest

from sidecar.broker.ports import free_port
from tests.kafka_helpers import (
    HoldableClock,
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    ThreadedSidecar,
    TopicFactory,
    assert_once_each,
    outbound_end,
    produce_due,
    run_args,
    scrape,
    settings_for,
    start_serving,
    wait_for,
)

COUNT = 2_000
# Far enough ahead that intake (of a sidecar serving already: start_serving) sees every record as
# not yet near due, beyond the read-ahead these tests run with (READ_AHEAD, not the default 10 s:
# the suite's time), so each one either goes to the cache or is left for a read-back.
LEAD_MS = 8_000
READ_AHEAD = ("--read-ahead-ms", "2000")


def scattered(due: int) -> list[int]:
    """Deliver-at times over 2 s in no rising order: each record is indexed and its payload cached."""
    return [due + (i * 7_919) % 2_000 for i in range(COUNT)]


def reads(port: int, topic: str, source: str) -> float:
    return scrape(port, "delay_sidecar_payload_reads_total", topic=topic, source=source)


def delivered_all(kafka_helper: KafkaHelper, topic: str, partitions: int = 1) -> Callable[[], bool]:
    return lambda: outbound_end(kafka_helper, f"{topic}.a", partitions) >= COUNT


def setup(
    topic_factory: TopicFactory, policy_file: PolicyFile, name: str, partitions: int = 1
) -> tuple[str, Path, int]:
    topic = topic_factory(name, partitions=partitions)
    return topic, policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n"), free_port()


@pytest.mark.parametrize("read_ahead_ms", ["0", "2000"])
def test_cached_payloads_are_delivered_without_a_read_back(
    read_ahead_ms: str,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
) -> None:
    """With read-ahead, the cache is scanned ahead of deliver-at; without, when the records fall due."""
    topic, policies, port = setup(topic_factory, policy_file, "hit")
    args = run_args(kafka, policies, tmp_path / "state", port, f"g-{topic}", "--read-ahead-ms", read_ahead_ms)
    sidecar = SidecarProcess(args, tmp_path / "log")
    try:
        start_serving(sidecar, port)
        due = int(time.time() * 1000) + LEAD_MS
        produce_due(kafka_helper, topic, scattered(due))
        wait_for(delivered_all(kafka_helper, topic), 60, "every record delivered")
        wait_for(lambda: reads(port, topic, "cache") == COUNT, 10, "every payload counted as a cache hit")
        assert reads(port, topic, "log") == 0
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 0, 30, "a checkpoint")
        # Delivered and checkpointed: their entries are deleted (the second still pending may stay).
        wait_for(lambda: scrape(port, "delay_sidecar_payload_cache_bytes") < 200 * COUNT // 2, 30, "deletion")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", COUNT)


def test_payloads_over_the_budget_are_read_back_from_the_log(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, policies, port = setup(topic_factory, policy_file, "miss")
    # A payload costs about 100 bytes in the cache: the budget holds about a tenth of them.
    args = run_args(
        kafka, policies, tmp_path / "state", port, f"g-{topic}", "--payload-cache-bytes", "20000", *READ_AHEAD
    )
    sidecar = SidecarProcess(args, tmp_path / "log")
    try:
        start_serving(sidecar, port)
        due = int(time.time() * 1000) + LEAD_MS
        produce_due(kafka_helper, topic, scattered(due))
        wait_for(delivered_all(kafka_helper, topic), 60, "every record delivered")
        wait_for(lambda: reads(port, topic, "cache") + reads(port, topic, "log") == COUNT, 10, "every payload")
        assert 0 < reads(port, topic, "cache") < COUNT // 2
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", COUNT)
    assert sidecar.log.read_text().count("payload cache full") == 1


def test_the_horizon_passing_over_the_index_brings_payloads_into_the_cache(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Records delayed beyond the horizon are not cached at intake; as the horizon reaches them, the
    roll reads their offset ranges from the log in bulk and caches them, so at due time (no
    read-ahead here) every payload comes from the cache.

    The sidecar's clock is held from the records' production until the roll is over: on a loaded
    machine a roll that started late, or took seconds, let the first records fall due before it
    cached them (read back from the log: right, but not what this test is about)."""
    caplog.set_level(logging.INFO, logger="sidecar.dispatch.roll")
    topic, policies, _ = setup(topic_factory, policy_file, "roll")
    horizon = 2_000
    settings = settings_for(kafka, policies, tmp_path / "state", group_id=f"g-{topic}",
                            payload_cache_horizon_ms=horizon, read_ahead_ms=0)  # fmt: skip
    clock = HoldableClock()
    with ThreadedSidecar(settings, clock) as sidecar:
        assert sidecar.app.sidecar is not None and sidecar.app.sidecar._roll is not None
        roll = sidecar.app.sidecar._roll
        with clock.held():
            due = clock.now_ms() + LEAD_MS
            produce_due(kafka_helper, topic, scattered(due))
            wait_for(lambda: sidecar.metric("delay_sidecar_tracked_messages", topic=topic) == COUNT, 60,
                     "every record indexed")  # fmt: skip
            # A roll reads what intake had read by the roll before it: one roll whose window ends
            # short of the records, then one whose window covers them all, just before their time.
            for at in (due - horizon - 500, due - 1):
                clock.move_to(at)
                wait_for(lambda at=at: roll.rolled_until == at + horizon and not roll.busy, 60,  # type: ignore[misc]
                         f"the roll at {at}")  # fmt: skip
        wait_for(delivered_all(kafka_helper, topic), 60, "every record delivered")
        wait_for(lambda: sidecar.metric("delay_sidecar_payload_reads_total", topic=topic, source="cache") == COUNT,
                 30, "every payload read from the cache")  # fmt: skip
    # Every payload was cached by a roll: none at intake, beyond the horizon then.
    rolled = [cast(tuple[int, ...], r.args) for r in caplog.records if r.getMessage().startswith("payload cache roll")]
    assert sum(args[3] for args in rolled) == COUNT, rolled
    assert_once_each(kafka_helper, f"{topic}.a", COUNT)


@pytest.mark.parametrize("lost", ["deleted", "corrupt", "kill -9"])
def test_a_lost_cache_loses_nothing_and_delivers_nothing_early(
    lost: str,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
) -> None:
    """The cache is gone, garbage or left by a crash when the sidecar starts again: it is dropped and
    every payload is read back from the log."""
    topic, policies, port = setup(topic_factory, policy_file, "lost", partitions=2)
    state = tmp_path / "state"
    sidecar = SidecarProcess(run_args(kafka, policies, state, port, f"g-{topic}", *READ_AHEAD), tmp_path / "log")
    try:
        start_serving(sidecar, port)
        due = int(time.time() * 1000) + LEAD_MS
        produce_due(kafka_helper, topic, scattered(due), partitions=2)
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == COUNT, 30, "a checkpoint")
        wait_for(lambda: scrape(port, "delay_sidecar_payload_cache_bytes") > 0, 10, "cached payloads")
        if lost == "kill -9":
            sidecar.kill()
        else:
            assert sidecar.stop() == 0, sidecar.tail()
            if lost == "deleted":
                shutil.rmtree(state / "cache")
            else:
                for file in (state / "cache").iterdir():
                    if file.name == "CURRENT" or file.suffix == ".sst":
                        file.write_bytes(b"garbage")
        sidecar.start()
        wait_for(delivered_all(kafka_helper, topic, 2), 60, "every record delivered")
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 0, 30, "a checkpoint")
        assert reads(port, topic, "cache") == 0
        assert reads(port, topic, "log") > 0
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", COUNT)
    if lost != "deleted":
        assert "payload cache dropped" in sidecar.log.read_text() or "cannot be opened" in sidecar.log.read_text()
