"""A failure inside the assignment callback is the engine's to raise, never librdkafka's."""

from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from sidecar.clock import ManualClock
from sidecar.errors import BrokerError
from sidecar.partitions.assignment import Assignment
from sidecar.partitions.metadata import CommitMetadata
from sidecar.partitions.state import PartitionState
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


class GroupConsumer:
    """The consumer calls an assignment makes, answered from `commits`: (offset, metadata) by partition."""

    def __init__(self) -> None:
        self.commits: dict[tuple[str, int], tuple[int, str]] = {}
        self.starts: list[TopicPartition] = []

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        found = []
        for tp in partitions:
            offset, metadata = self.commits.get((tp.topic, tp.partition), (-1001, ""))
            found.append(TopicPartition(tp.topic, tp.partition, offset, metadata=metadata))
        return found

    def assign(self, starts: list[TopicPartition]) -> None:
        self.starts = starts

    def resume(self, partitions: list[TopicPartition]) -> None:
        pass


def member(exact: bool = False) -> tuple[Assignment, GroupConsumer, list[PartitionState], list[str]]:
    """An assignment over in-memory trackers; the states it closed, and the calls to drop what is unsent."""
    clock = ManualClock()
    closed: list[PartitionState] = []
    dropped: list[str] = []
    assignment = Assignment(
        lambda t, p: InMemoryTracker(clock), lambda t: False, lambda: None, closed.append,
        lambda: dropped.append("abort"), end_of=lambda t, p: 0, exact=exact,
    )  # fmt: skip
    return assignment, GroupConsumer(), closed, dropped


def read_on(assignment: Assignment, consumer: GroupConsumer) -> PartitionState:
    """Partition t/0 assigned from its commit at 10, then read on to 15 and not committed since."""
    consumer.commits[("t", 0)] = (10, CommitMetadata(4).encode())
    assignment.on_assign(cast(Consumer, consumer), [TopicPartition("t", 0)])
    state = assignment.states[("t", 0)]
    state.next_offset = 15
    return state


def test_at_least_once_lost_partitions_given_back_unchanged_go_on_where_they_were() -> None:
    """Before: a loss purged what the writer had queued and started the engine again from the last
    commit, which sent again everything acknowledged since (issue 48: 4,019 of 5,000 records twice
    after a broker restart)."""
    assignment, consumer, closed, dropped = member()
    state = read_on(assignment, consumer)
    assignment.on_lost(cast(Consumer, consumer), [TopicPartition("t", 0)])
    assert not assignment.failed and assignment.error is None and not dropped
    assert not assignment.states and assignment.kept == {("t", 0): state}  # neither delivered nor committed
    assignment.on_assign(cast(Consumer, consumer), [TopicPartition("t", 0)])
    assert assignment.states[("t", 0)] is state and not assignment.kept and not closed
    assert [(tp.topic, tp.partition, tp.offset) for tp in consumer.starts] == [("t", 0, 15)]


def test_at_least_once_lost_partitions_another_member_committed_start_from_its_commit() -> None:
    assignment, consumer, closed, _ = member()
    state = read_on(assignment, consumer)
    assignment.on_lost(cast(Consumer, consumer), [TopicPartition("t", 0)])
    consumer.commits[("t", 0)] = (12, CommitMetadata(6).encode())  # another member's commit since
    assignment.on_assign(cast(Consumer, consumer), [TopicPartition("t", 0)])
    assert closed == [state] and assignment.states[("t", 0)] is not state
    assert [tp.offset for tp in consumer.starts] == [6]  # its index rebuilt from the earliest pending


def test_at_least_once_lost_partitions_that_go_to_another_member_are_closed_at_the_next_assignment() -> None:
    assignment, consumer, closed, _ = member()
    state = read_on(assignment, consumer)
    assignment.on_lost(cast(Consumer, consumer), [TopicPartition("t", 0)])
    assignment.on_assign(cast(Consumer, consumer), [TopicPartition("t", 1)])
    assert closed == [state] and not assignment.kept and set(assignment.states) == {("t", 1)}


def test_exactly_once_lost_partitions_abort_the_transaction_and_start_again() -> None:
    assignment, consumer, closed, dropped = member(exact=True)
    state = read_on(assignment, consumer)
    assignment.on_lost(cast(Consumer, consumer), [TopicPartition("t", 0)])
    assert dropped == ["abort"] and closed == [state] and not assignment.kept
    assert assignment.failed and isinstance(assignment.error, BrokerError)
    assert "starts again from the last checkpoint" in str(assignment.error)


def test_at_least_once_a_lost_partition_mid_drain_is_not_kept() -> None:
    """Its drain would go on dead-lettering a partition another member may own already."""
    assignment, consumer, closed, _ = member()
    state = read_on(assignment, consumer)
    state.drain_from = 12
    assignment.on_lost(cast(Consumer, consumer), [TopicPartition("t", 0)])
    assert closed == [state] and not assignment.kept and not assignment.failed


def test_at_least_once_lost_partitions_whose_unanswered_commit_landed_go_on_where_they_were() -> None:
    """A periodic commit sent and never heard back of (the consumer made again, inbound/member.py,
    or the answer lost to the outage) may be the group's commit: it is this member's own."""
    assignment, consumer, closed, _ = member()
    state = read_on(assignment, consumer)
    sent = CommitMetadata(9)
    state.sent_fingerprint = sent.fingerprint_at(15)
    assignment.on_lost(cast(Consumer, consumer), [TopicPartition("t", 0)])
    consumer.commits[("t", 0)] = (15, sent.encode())  # it landed
    assignment.on_assign(cast(Consumer, consumer), [TopicPartition("t", 0)])
    assert assignment.states[("t", 0)] is state and not closed
    assert state.committed == (15, sent.encode()) and state.committed_fingerprint == sent.fingerprint_at(15)
    assert [tp.offset for tp in consumer.starts] == [15]


def test_at_least_once_the_partitions_set_aside_for_a_new_consumer_are_kept_whatever_the_old_one_says() -> None:
    """The old consumer, closing on a thread of its own after the member made a new one, revokes
    what it had: no checkpoint, nothing closed, and the new consumer's assignment takes them up."""
    checkpoints: list[str] = []
    clock = ManualClock()
    closed: list[PartitionState] = []
    old, new = GroupConsumer(), GroupConsumer()
    now = [old]
    assignment = Assignment(
        lambda t, p: InMemoryTracker(clock), lambda t: False, lambda: checkpoints.append("checkpoint"),
        closed.append, end_of=lambda t, p: 0, current=lambda consumer: consumer is now[0],
    )  # fmt: skip
    state = read_on(assignment, old)
    assignment.set_aside(cast(Consumer, old))
    now[0] = new
    assignment.on_revoke(cast(Consumer, old), [TopicPartition("t", 0)])
    assignment.on_lost(cast(Consumer, old), [TopicPartition("t", 0)])
    assert assignment.kept == {("t", 0): state} and not closed and not checkpoints
    new.commits = old.commits
    assignment.on_assign(cast(Consumer, new), [TopicPartition("t", 0)])
    assert assignment.states[("t", 0)] is state and not assignment.kept
