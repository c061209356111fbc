"""A held partition delivers again only once intake has taken every record below the hold's end
(partitions/holds.py). No broker: the consumer's position is given."""

from confluent_kafka import TopicPartition

from sidecar.clock import ManualClock
from sidecar.partitions.holds import Holds
from sidecar.partitions.state import PartitionState
from sidecar.tracker.memory import InMemoryTracker


class Record:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._at = (topic, partition, offset)

    def topic(self) -> str:
        return self._at[0]

    def partition(self) -> int:
        return self._at[1]

    def offset(self) -> int:
        return self._at[2]


def held() -> tuple[Holds, PartitionState, list[PartitionState]]:
    """Partition t/0 held until 189; the consumer has returned records up to 193 (position 194)."""
    state = PartitionState("t", 0, InMemoryTracker(ManualClock(0)))
    state.hold_until = 189
    released: list[PartitionState] = []
    holds = Holds(
        {("t", 0): state},
        lambda tps: [TopicPartition(tp.topic, tp.partition, 194) for tp in tps],
        None,  # type: ignore[arg-type]  # the stable end is not asked: the position is past the hold
        released.append,
    )
    return holds, state, released


def test_a_hold_is_not_released_while_records_below_its_end_are_still_to_take() -> None:
    """Between two slices of a batch the consumer's position is past the batch; an earlier owner's
    fact may be in the slices not taken yet."""
    holds, state, released = held()
    holds.release([Record("t", 1, 10), Record("t", 0, 150), Record("t", 0, 151)])
    assert state.hold_until == 189 and released == []
    holds.release([Record("t", 0, 189), Record("t", 0, 190)])  # nothing below the end is left
    assert state.hold_until is None and released == [state]


def test_a_hold_is_released_at_the_end_of_a_batch() -> None:
    holds, state, released = held()
    holds.release()
    assert state.hold_until is None and released == [state]
