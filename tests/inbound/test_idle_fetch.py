"""IdleFetch: partitions at their end are paused, and come back; the rules with a fake consumer,
then the round trip with a real one (librdkafka's end report after a seek is what it rests on)."""

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from sidecar.app import idle_fetch_pause_ms
from sidecar.broker import ApacheKafka, EmbeddedBroker, ExternalBroker
from sidecar.clock import ManualClock
from sidecar.inbound.idle_fetch import IdleFetch
from sidecar.partitions.assignment import Assignment
from sidecar.tracker import InMemoryTracker
from tests.fake_clock import MonotonicClock
from tests.kafka_helpers import KafkaHelper

P, Q = ("orders", 0), ("orders", 1)


def record(partition: tuple[str, int], offset: int) -> Message:
    return Message(topic=partition[0], partition=partition[1], offset=offset, value=b"v")


def end(partition: tuple[str, int], offset: int) -> Message:
    return Message(
        topic=partition[0], partition=partition[1], offset=offset, error=KafkaError(KafkaError._PARTITION_EOF)
    )


class FakeConsumer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.positions: dict[tuple[str, int], int] = {}

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.calls.append(("pause", sorted((tp.topic, tp.partition) for tp in partitions)))

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.calls.append(("resume", sorted((tp.topic, tp.partition) for tp in partitions)))

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.positions.get((tp.topic, tp.partition), -1001))
                for tp in partitions]  # fmt: skip

    def seek(self, partition: TopicPartition) -> None:
        self.calls.append(("seek", (partition.topic, partition.partition, partition.offset)))

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float | None = None, cached: bool = False
    ) -> tuple[int, int]:
        self.calls.append(("ends", (partition.topic, partition.partition, cached)))
        return 0, 0


def setup(paced: Callable[[tuple[str, int]], bool] = lambda p: True) -> tuple[IdleFetch, FakeConsumer, MonotonicClock]:
    consumer, clock = FakeConsumer(), MonotonicClock(100.0)
    return IdleFetch(consumer, 10, paced, clock), consumer, clock


def test_an_end_pauses_its_partition_and_a_resume_seeks_where_it_stands() -> None:
    idle, consumer, clock = setup()
    kept = idle.take([record(P, 4), end(P, 5), record(Q, 9)])
    assert [(r.partition(), r.offset()) for r in kept] == [(0, 4), (1, 9)]  # the end report is not a record
    assert consumer.calls == [("pause", [P])]
    assert idle.wait_s(1.0) == pytest.approx(0.01)  # the loop wakes up to resume it
    clock.now = 100.005
    assert idle.take([]) == [] and consumer.calls == [("pause", [P])]
    clock.now = 100.02
    consumer.positions[P] = 5
    idle.take([])
    assert consumer.calls[1:] == [("resume", [P]), ("seek", ("orders", 0, 5))]
    assert idle.wait_s(1.0) == 1.0


def test_a_partition_never_written_is_sought_to_0_and_its_broker_asked_its_end() -> None:
    """Sought to 0 and no more, a paused partition fetched again up to a second after its resume:
    the question to its broker is what wakes librdkafka (`IdleFetch._wake`)."""
    idle, consumer, clock = setup()
    idle.take([end(P, 0)])
    clock.now += 1
    idle.take([])
    assert consumer.calls[-2:] == [("seek", ("orders", 0, 0)), ("ends", ("orders", 0, False))]
    assert idle.position([TopicPartition(*P)])[0].offset == 0  # the end reached, while librdkafka's is unknown


def test_records_after_the_end_in_the_same_batch_keep_the_partition_fetching() -> None:
    idle, consumer, _ = setup()
    consumer.positions[P] = 6  # librdkafka's position is past the end once record 5 is consumed
    assert len(idle.take([end(P, 5), record(P, 5), end(Q, 3)])) == 1
    assert consumer.calls == [("pause", [Q])]


def test_partitions_the_engine_holds_or_lost_are_neither_paused_nor_resumed() -> None:
    served = {P, Q}
    idle, consumer, clock = setup(lambda p: p in served)
    idle.take([end(("removed", 0), 7), end(P, 1), end(Q, 2)])
    assert consumer.calls == [("pause", [P, Q])]
    served.discard(Q)  # revoked, or draining: the engine's now
    clock.now += 1
    consumer.positions.update({P: 1})
    idle.take([])
    assert consumer.calls[1:] == [("resume", [P]), ("seek", ("orders", 0, 1))]


def test_off_it_passes_everything_through() -> None:
    consumer = FakeConsumer()
    idle = IdleFetch(consumer, 0, lambda p: True)
    batch = [record(P, 1), end(P, 2)]
    assert idle.take(batch) is batch and consumer.calls == []


@pytest.mark.parametrize("written", [3, 0], ids=["written", "never-written"])
def test_a_real_consumer_is_paused_at_its_end_and_reads_what_came_meanwhile_once(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str], written: int
) -> None:
    """Never written, the partition is sought to 0 and woken (`IdleFetch._wake`) at each resume."""
    topic = topic_factory("idle")
    for i in range(written):
        kafka_helper.produce(topic, f"a{i}".encode(), partition=0)
    kafka_helper.flush()
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": f"g-{topic}", "enable.partition.eof": True})
    consumer.assign([TopicPartition(topic, 0, 0)])
    idle = IdleFetch(consumer, 50, lambda p: True)
    seen: Counter[bytes] = Counter()
    pauses = 0

    def turn() -> None:
        nonlocal pauses
        before = len(idle._paused)
        for r in idle.take(consumer.consume(100, idle.wait_s(0.05))):
            seen[r.value()] += 1
        pauses += len(idle._paused) > before

    try:
        deadline = time.monotonic() + 30
        while pauses < 3 and time.monotonic() < deadline:  # reached its end, and again after resumes
            turn()
        assert pauses >= 3, "the end was not reported again after a resume"
        for i in range(3):
            kafka_helper.produce(topic, f"b{i}".encode(), partition=0)
        kafka_helper.flush()
        while sum(seen.values()) < written + 3 and time.monotonic() < deadline:
            turn()
        end_at = time.monotonic() + 0.5
        while time.monotonic() < end_at:
            turn()
    finally:
        consumer.close()
    assert seen == Counter({f"{x}{i}".encode(): 1 for x, n in (("a", written), ("b", 3)) for i in range(n)})


Hook = Callable[[Consumer, list[TopicPartition]], object]


def read_after_a_paused_rebalance(
    kafka: str, kafka_helper: KafkaHelper, topic: str, leave: Hook, back: Hook
) -> list[bytes]:
    """Partition 0 of `topic`, paused at its end, leaves the consumer (`leave`, then an unassign) and
    comes back (`back`); what the consumer reads then of a record written after."""
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": f"g-{topic}", "auto.offset.reset": "earliest"})
    got: list[bytes] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        consumer.pause([TopicPartition(topic, 0, 0)])  # at its end when the group took it away
        consumer.poll(0.5)  # librdkafka applies pauses and assignments in turn, on its own thread
        leave(consumer, [TopicPartition(topic, 0)])
        consumer.unassign()
        consumer.poll(0.5)
        back(consumer, [TopicPartition(topic, 0)])
        kafka_helper.produce(topic, b"after", partition=0)
        kafka_helper.flush()
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got += [r.value() for r in consumer.consume(10, 0.2) if r.error() is None]
    finally:
        consumer.close()
    return got


def assignment_of(clock: ManualClock) -> Assignment:
    return Assignment(
        lambda t, p: InMemoryTracker(clock), lambda t: False, lambda: None, lambda s: None, end_of=lambda t, p: 0
    )


def test_a_partition_paused_when_it_was_revoked_fetches_again_once_assigned_again(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str], clock: ManualClock
) -> None:
    """librdkafka keeps a partition paused across unassign and assign; IdleFetch forgets it at the
    revoke. Before Assignment resumed what it assigns, the partition never read again."""
    topic = topic_factory("reassigned")
    got = read_after_a_paused_rebalance(kafka, kafka_helper, topic, lambda c, ps: None, assignment_of(clock).on_assign)
    assert got == [b"after"]


@pytest.mark.parametrize("leaving", ["revoked", "lost"])
def test_a_partition_paused_when_it_leaves_is_not_paused_when_it_comes_back(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str], clock: ManualClock, leaving: str
) -> None:
    """The resume sent with an assignment can be lost in librdkafka (librdkafka#5591; a CI run saw a
    member never read a control partition it kept through a rebalance). A partition IdleFetch paused
    is resumed as it leaves, so it comes back unpaused even when nothing resumes it then: here the
    consumer alone assigns it again."""
    topic, assignment = topic_factory("leaving"), assignment_of(clock)
    leave = assignment.on_revoke if leaving == "revoked" else assignment.on_lost
    got = read_after_a_paused_rebalance(kafka, kafka_helper, topic, leave, lambda c, ps: c.assign(ps))
    assert got == [b"after"]


def test_while_a_seek_hides_the_position_the_end_reached_stands_for_it_until_the_partition_is_revoked() -> None:
    """The engine's holds end on the consumer's position: after a seek librdkafka reports none until a
    record comes, and the hold past an open transaction never ended (a test in test_cancel.py)."""
    idle, consumer, clock = setup()
    idle.take([end(P, 6)])
    clock.now += 1
    idle.take([])  # resumed and sought: librdkafka's position is unknown now
    assert [(tp.partition, tp.offset) for tp in idle.position([TopicPartition(*P), TopicPartition(*Q)])] == [
        (0, 6),
        (1, -1001),
    ]
    consumer.positions[P] = 9  # records came
    assert idle.position([TopicPartition(*P)])[0].offset == 9
    consumer.positions.pop(P)
    idle.forget(P)  # revoked: a new owner starts from its commit, not from this end
    assert idle.position([TopicPartition(*P)])[0].offset == -1001


def test_the_pause_defaults_to_the_broker_the_sidecar_started(tmp_path: Path) -> None:
    """Apache Kafka holds an empty fetch, and pausing there cost the sidecar 0.09 core for nothing
    (docs/benchmarks.md); noida-db answers it at once. Of a cluster it was handed, it cannot tell."""
    embedded = EmbeddedBroker(tmp_path / "noida", port=1)
    apache, external = ApacheKafka(tmp_path / "kafka", port=2), ExternalBroker("k:9092")
    assert [idle_fetch_pause_ms(None, b) for b in (embedded, apache, external)] == [10, 0, 0]
    assert [idle_fetch_pause_ms(25, b) for b in (embedded, apache, external)] == [25, 25, 25]
    assert idle_fetch_pause_ms(0, embedded) == 0
