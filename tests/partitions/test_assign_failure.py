"""A failure inside the assignment callback is the engine's to raise, never librdkafka's."""

import logging
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from sidecar.broker.ports import free_port
from sidecar.clock import ManualClock
from sidecar.errors import BrokerError
from sidecar.outbound.writer import Writer
from sidecar.partitions.assignment import Assignment
from sidecar.tracker import InMemoryTracker


class ClosingConsumer:
    """What a consumer inside close() answers when a rebalance reaches it: its handle is going."""

    def committed(self, partitions: list[TopicPartition], timeout: float) -> Any:
        raise KafkaException(KafkaError(KafkaError._DESTROY, "Failed to get committed offsets"))


def test_commits_that_cannot_be_read_fail_the_engine_instead_of_raising_into_the_client() -> None:
    """Before: the KafkaException left on_assign, librdkafka re-raised it out of consumer.close()
    as a bare KafkaError, which no `except` clause matches, and a clean stop exited 1 (CI, a
    three-member handoff)."""
    clock = ManualClock()
    assignment = Assignment(
        lambda t, p: InMemoryTracker(clock), lambda t: False, lambda: None, lambda s: None, end_of=lambda t, p: 0
    )
    assignment.on_assign(cast(Consumer, ClosingConsumer()), [TopicPartition("t", 0)])
    assert assignment.failed and isinstance(assignment.error, BrokerError)
    assert "starts again from the last commit" in str(assignment.error)
    assert not assignment.states and not assignment.assigned.is_set()


class ResumingConsumer:
    def resume(self, partitions: list[TopicPartition]) -> None:
        pass


def test_lost_partitions_drop_the_queued_copies_and_start_again_at_least_once() -> None:
    """Before: at least once, a loss kept what the producer had queued while the broker was away; the
    partitions came back restored from the last checkpoint and their due records were sent again,
    so the queued first copies reached the broker beside the second ones."""
    writer = Writer({"bootstrap.servers": f"127.0.0.1:{free_port()}"}, logging.getLogger("librdkafka"))
    try:
        for i in range(100):  # nobody listens: they stay queued
            writer.send("t", None, b"%d" % i, [], 0)
        assert len(writer.producer) >= 100
        clock = ManualClock()
        assignment = Assignment(
            lambda t, p: InMemoryTracker(clock), lambda t: False, lambda: None, lambda s: None,
            writer.drop_unacknowledged, end_of=lambda t, p: 0,
        )  # fmt: skip
        assignment.on_lost(cast(Consumer, ResumingConsumer()), [TopicPartition("t", 0)])
        assert len(writer.producer) == 0, f"{len(writer.producer)} copies still queued after the loss"
        assert assignment.failed and isinstance(assignment.error, BrokerError)
        assert "starts again from the last checkpoint" in str(assignment.error)
        writer.flush()  # the purge is no failure of the writes
    finally:
        writer.close(clean=False)
