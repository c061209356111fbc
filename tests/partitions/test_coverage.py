"""The check that the group assigns what this member subscribes to, without a broker."""

import pytest

from sidecar.partitions import coverage
from sidecar.partitions.coverage import Coverage, GroupView, wrong_topics


def test_wrong_topics_are_those_assigned_to_nobody_or_to_this_member_unasked() -> None:
    partitions = {"a": 3, "b": 3, "control": 3, "empty": 0}
    assert wrong_topics({"a", "b", "control"}, partitions, {"a", "b", "control"}, {"a"}) == frozenset()
    assert wrong_topics({"a", "b", "control"}, partitions, {"a", "control"}, {"a"}) == {"b"}
    assert wrong_topics({"a", "gone", "empty"}, partitions, {"a"}, {"a"}) == frozenset()  # nothing to assign
    assert wrong_topics({"a"}, partitions, {"a", "b"}, {"a", "b"}) == {"b"}  # held, not subscribed to


class Group:
    """A stand-in consumer and coordinator: assigns what the member subscribed to last, unless
    the member came back with a subscription its stored assignment does not follow."""

    def __init__(self, stored: frozenset[str]) -> None:
        self.assigned = stored
        self.assignments = 1
        self.subscriptions: list[list[str]] = []
        self.stable = True

    def subscribe(self, topics: list[str]) -> None:
        self.subscriptions.append(topics)
        self.assigned = frozenset(topics)  # new metadata: the coordinator rebalances
        self.assignments += 1

    def view(self) -> GroupView:
        return self.stable, self.assigned


def coverage_of(group: Group) -> Coverage:
    return Coverage(
        group.view, lambda: group.assigned, lambda: {"a": 1, "b": 1, "c": 1}, group.subscribe, lambda: group.assignments
    )


@pytest.fixture(autouse=True)
def no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coverage, "LOOK_EVERY_S", 0.0)


def test_a_topic_the_stored_assignment_lacks_is_assigned_after_two_subscribes() -> None:
    group = Group(frozenset({"a", "c"}))
    check = coverage_of(group)
    check.watch(frozenset({"a", "b", "c"}))
    group.stable = False
    check.turn()
    assert group.subscriptions == []  # a rebalance under way: nothing judged
    group.stable = True
    for _ in range(5):
        check.turn()
    assert group.subscriptions == [["a", "c"], ["a", "b", "c"]]
    assert group.assigned == {"a", "b", "c"}


def test_a_topic_held_but_not_subscribed_to_is_given_back() -> None:
    group = Group(frozenset({"a", "b", "c"}))
    check = coverage_of(group)
    check.watch(frozenset({"a", "b"}))
    for _ in range(5):
        check.turn()
    assert group.subscriptions == [["b"], ["a", "b"]]
    assert group.assigned == {"a", "b"}


def test_a_right_assignment_is_left_alone() -> None:
    group = Group(frozenset({"a", "b"}))
    check = coverage_of(group)
    check.watch(frozenset({"a", "b"}))
    for _ in range(5):
        check.turn()
    assert group.subscriptions == []


def test_a_group_that_stays_wrong_is_asked_a_bounded_number_of_times() -> None:
    group = Group(frozenset({"a"}))

    def assigned_as_before(topics: list[str]) -> None:
        group.subscriptions.append(topics)
        group.assignments += 1

    group.subscribe = assigned_as_before  # type: ignore[method-assign]
    check = coverage_of(group)
    check.watch(frozenset({"a", "b"}))
    for _ in range(50):
        check.turn()
    assert len(group.subscriptions) == 2 * coverage.MAX_ASKS
