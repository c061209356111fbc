"""A start whose subscription the group may not know forces one rebalance, without a broker."""

from pathlib import Path

from sidecar.partitions.coverage import FILE, Coverage


class Consumer:
    """The calls the check makes, and the assignments the group gives after each subscribe."""

    def __init__(self) -> None:
        self.subscriptions: list[list[str]] = []
        self.assignments = 0

    def subscribe(self, topics: list[str]) -> None:
        self.subscriptions.append(topics)

    def assigned(self) -> None:
        self.assignments += 1


def start(state_dir: Path, topics: list[str]) -> tuple[Coverage, Consumer]:
    consumer = Consumer()
    check = Coverage(state_dir, consumer.subscribe, lambda: consumer.assignments)
    consumer.subscribe(topics)
    check.subscribed(topics, first=True)
    return check, consumer


def run_to_end(check: Coverage, consumer: Consumer) -> None:
    for _ in range(5):
        check.turn()
        consumer.assigned()


def test_a_start_with_the_remembered_topics_forces_nothing(tmp_path: Path) -> None:
    run_to_end(*start(tmp_path, ["a", "ctl"]))
    check, consumer = start(tmp_path, ["a", "ctl"])
    run_to_end(check, consumer)
    assert consumer.subscriptions == [["a", "ctl"]]


def test_a_start_with_other_topics_subscribes_away_and_back_after_the_first_assignment(tmp_path: Path) -> None:
    """The stored assignment lacks the added topic until the group assigns again (issue 48: 0 of 400 served)."""
    run_to_end(*start(tmp_path, ["a", "ctl"]))
    check, consumer = start(tmp_path, ["a", "b", "ctl"])
    check.turn()
    assert consumer.subscriptions == [["a", "b", "ctl"]]  # nothing before the first assignment
    consumer.assigned()
    check.turn()
    assert consumer.subscriptions[-1] == ["b", "ctl"]  # new member metadata: the coordinator rebalances
    check.turn()
    assert len(consumer.subscriptions) == 2  # waits for that assignment
    consumer.assigned()
    run_to_end(check, consumer)
    assert consumer.subscriptions == [["a", "b", "ctl"], ["b", "ctl"], ["a", "b", "ctl"]]
    assert (tmp_path / FILE).read_text() == '["a", "b", "ctl"]'


def test_a_new_state_dir_and_no_state_dir_force_nothing(tmp_path: Path) -> None:
    check, consumer = start(tmp_path / "new", ["a", "ctl"])
    run_to_end(check, consumer)
    assert len(consumer.subscriptions) == 1
    assert (tmp_path / "new" / FILE).read_text() == '["a", "ctl"]'  # remembered for the next start
    consumer = Consumer()
    check = Coverage(None, consumer.subscribe, lambda: consumer.assignments)
    check.subscribed(["a", "ctl"], first=True)
    run_to_end(check, consumer)
    assert consumer.subscriptions == []


def test_a_live_change_forces_nothing(tmp_path: Path) -> None:
    check, consumer = start(tmp_path, ["a", "ctl"])
    run_to_end(check, consumer)
    count = len(consumer.subscriptions)
    check.subscribed(["a", "b", "ctl"], first=False)
    run_to_end(check, consumer)
    assert len(consumer.subscriptions) == count
    assert (tmp_path / FILE).read_text() == '["a", "b", "ctl"]'
