"""A failure inside the assignment callback is the engine's to raise, never librdkafka's."""

from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from sidecar.clock import ManualClock
from sidecar.errors import BrokerError
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
