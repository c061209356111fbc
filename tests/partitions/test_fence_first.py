"""Exactly once, an assigned partition's earlier producers are fenced before its commit is read
stably: a zombie stopped inside its commit holds the group's newer offsets in its transaction, and
a stable read (read_committed, KIP-447) waits for that transaction, which ends with the fence."""

from typing import cast

from confluent_kafka import Consumer, TopicPartition

from sidecar.clock import ManualClock
from sidecar.partitions.assignment import Assignment
from sidecar.partitions.metadata import CommitMetadata
from sidecar.tracker import InMemoryTracker


class Group:
    """The last commits and the stable ones of partition t/0, and the order of every call."""

    def __init__(self, last: tuple[int, str | None], stable: tuple[int, str | None]) -> None:
        self.last, self.stable = last, stable
        self.calls: list[str] = []
        self.starts: list[TopicPartition] = []

    def _answer(self, commit: tuple[int, str | None], partitions: list[TopicPartition]) -> list[TopicPartition]:
        offset, producer = commit
        metadata = CommitMetadata(offset, producer=producer).encode()
        return [TopicPartition(tp.topic, tp.partition, offset, metadata=metadata) for tp in partitions]

    def last_commits(self, partitions: list[TopicPartition], timeout_s: float) -> list[TopicPartition]:
        self.calls.append("last")
        return self._answer(self.last, partitions)

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        self.calls.append("stable")
        return self._answer(self.stable, partitions)

    def fence(self, producer: str) -> bool:
        """True when fenced now, as the writer's fence answers: False for one fenced before."""
        now = f"fence {producer}" not in self.calls
        self.calls.append(f"fence {producer}")
        return now

    def assign(self, starts: list[TopicPartition]) -> None:
        self.starts = starts

    def resume(self, partitions: list[TopicPartition]) -> None:
        pass


def assign(group: Group) -> Assignment:
    clock = ManualClock()
    assignment = Assignment(
        lambda t, p: InMemoryTracker(clock), lambda t: False, lambda: None, lambda s: None, end_of=lambda t, p: 0,
        exact=True, fence=group.fence, last_commits=group.last_commits,
    )  # fmt: skip
    assignment.on_assign(cast(Consumer, group), [TopicPartition("t", 0)])
    assert not assignment.failed, assignment.error
    return assignment


def test_the_producer_of_the_last_commit_is_fenced_before_the_stable_read() -> None:
    group = Group(last=(10, "zombie-1"), stable=(10, "zombie-1"))
    assign(group)
    assert group.calls[:3] == ["last", "fence zombie-1", "stable"]


def test_the_partition_starts_from_the_stable_commit_not_from_the_last_one_read_first() -> None:
    """The zombie's transaction may commit before its fence: its offsets are then the group's."""
    group = Group(last=(10, "zombie-1"), stable=(12, "zombie-1"))
    assign(group)
    assert group.starts == [TopicPartition("t", 0, 12)]


def test_a_commit_that_names_no_producer_is_still_read_stably() -> None:
    group = Group(last=(10, None), stable=(12, None))
    assign(group)
    assert group.calls == ["last", "stable"]
    assert group.starts == [TopicPartition("t", 0, 12)]
