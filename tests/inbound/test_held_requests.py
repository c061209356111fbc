"""Requests an earlier owner decided, read by the member that took the partition over
(sidecar/inbound/commands.py): decided once, by whoever wrote a fact for them.

The churn bench found a cancel answered twice after a clean handoff at least once: the new owner
read the earlier owner's request past the commit, and decided it again before it read the fact
further on. No broker: the step's writer and outcomes are recorded.
"""

from typing import Any

from sidecar.clock import ManualClock
from sidecar.control.cancels import COMMAND_BY, FACT, REQUEST, Fact, Request
from sidecar.inbound.commands import CommandStep
from sidecar.partitions.state import PartitionState
from sidecar.policy.model import EffectiveDelay, Sourced
from sidecar.policy.routes import IntakeRule
from sidecar.tracker.memory import InMemoryTracker

GROUP = "g"
RULE = IntakeRule(EffectiveDelay(Sourced(True, "test"), Sourced(0, "test"), Sourced(0, "test")), None, ("a",))


class Record:
    def __init__(self, offset: int, headers: list[tuple[str, bytes | None]]) -> None:
        self._offset, self._headers = offset, headers

    def offset(self) -> int:
        return self._offset

    def headers(self) -> list[tuple[str, bytes | None]]:
        return self._headers


class Recorded:
    """The writer's and the outcomes' sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, *args: Any, **kwargs: Any) -> None:
        self.sent.append(args)


class Batch:
    def rule(self, topic: str, routes: object, retention_ms: int | None) -> IntakeRule:
        return RULE


class Routes:
    def rule(self, retention_ms: int | None) -> IntakeRule:
        return RULE


def request(offset: int, target: int, command_id: str) -> Record:
    body = Request("cancel", target, None, command_id, None, ("ctl", 0, offset), b"k").encode()
    return Record(offset, [(COMMAND_BY, GROUP.encode()), (REQUEST, body)])


def fact(offset: int, target: int, request_offset: int) -> Record:
    body = Fact(target, request_offset, ((target, "a"),)).encode()
    return Record(offset, [(COMMAND_BY, GROUP.encode()), (FACT, body)])


def taken_over(hold_until: int | None) -> tuple[CommandStep, PartitionState, Recorded, Recorded]:
    """A step and a partition whose records 5 and 6 are pending, held until `hold_until`."""
    writer, outcomes = Recorded(), Recorded()
    step = CommandStep(GROUP, writer, None, outcomes, None, {}, "ctl")  # type: ignore[arg-type]
    clock = ManualClock(0)
    state = PartitionState("t", 0, InMemoryTracker(clock))
    for target in (5, 6):
        state.tracker.add(target, 60_000)
    state.hold_until, state.next_offset = hold_until, 10
    return step, state, writer, outcomes


def answered(outcomes: Recorded) -> list[tuple[str, str]]:
    return [(o.id, o.outcome) for _, o in outcomes.sent]


def test_a_request_an_earlier_owner_decided_is_not_decided_again_when_its_fact_lies_further_on() -> None:
    step, state, writer, outcomes = taken_over(hold_until=20)
    # The earlier owner decided c1 (its fact at 12); c2 came after it lost the partition.
    step.take(Batch(), state, None, [request(10, 5, "c1"), fact(12, 5, 10), request(14, 6, "c2")])  # type: ignore[arg-type]
    assert outcomes.sent == [] and writer.sent == [], "nothing is decided before the hold's end is read"
    state.hold_until = None  # partitions/holds.py: the consumer's position reached the hold's end
    step.decide_released(state, Routes())  # type: ignore[arg-type]
    assert answered(outcomes) == [("c2", "cancelled")]
    assert [Fact.decode(dict(headers)[FACT]).request for _, _, _, headers in writer.sent] == [14]
    assert (state.held_requests, state.decided_earlier) == ([], set())


def test_a_request_read_at_or_past_the_hold_s_end_first_decides_those_set_aside_in_log_order() -> None:
    step, state, _, outcomes = taken_over(hold_until=12)
    step.take(Batch(), state, None, [request(10, 5, "c1"), request(13, 6, "c2")])  # type: ignore[arg-type]
    assert answered(outcomes) == [("c1", "cancelled"), ("c2", "cancelled")]


def test_without_a_hold_requests_are_decided_as_they_are_read() -> None:
    step, state, _, outcomes = taken_over(hold_until=None)
    step.take(Batch(), state, None, [request(10, 5, "c1")])  # type: ignore[arg-type]
    assert answered(outcomes) == [("c1", "cancelled")]


def test_requests_set_aside_are_decided_when_the_hold_ends_by_position_past_a_transaction_marker() -> None:
    """Exactly once the log ends in a commit marker, which no record reaches: the hold ends by the
    consumer's position (partitions/holds.py), and the requests set aside are decided then, not
    before. Deciding them only with a later record had left the chaos test's 2 cancels unanswered."""
    step, state, _, outcomes = taken_over(hold_until=20)
    step.take(Batch(), state, None, [request(10, 5, "c1")])  # type: ignore[arg-type]
    step.decide_released(state, Routes())  # type: ignore[arg-type]  # still held: nothing yet
    assert outcomes.sent == []
    state.hold_until = None
    step.decide_released(state, Routes())  # type: ignore[arg-type]
    assert answered(outcomes) == [("c1", "cancelled")]
