"""When full garbage collections run: between turns, idle or overdue, never automatically."""

import gc

from sidecar.collector import IDLE_S, MAX_INTERVAL_S, MIN_INTERVAL_S, NEVER, Collector
from tests.fake_clock import MonotonicClock


def test_automatic_full_collections_are_off_while_a_sidecar_runs_and_back_after_the_last_one_stops() -> None:
    before = gc.get_threshold()
    with Collector():
        assert gc.get_threshold() == (before[0], before[1], NEVER)
        assert gc.get_freeze_count() > 0  # what was there at start is never visited again
        with Collector():  # a second sidecar in the same process
            pass
        assert gc.get_threshold()[2] == NEVER, "the first sidecar still runs"
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_full_collection_runs_when_idle_at_most_every_min_interval() -> None:
    clock, passes = MonotonicClock(1000.0), []
    with Collector(lambda reason, seconds: passes.append(reason), clock) as collector:
        collector.between_turns(IDLE_S, idle=True)
        assert passes == [], "too soon after the start"
        clock.now += MIN_INTERVAL_S
        collector.between_turns(IDLE_S / 2, idle=True)
        collector.between_turns(IDLE_S, idle=False)
        assert passes == [], "a delivery is near, or intake is busy"
        collector.between_turns(IDLE_S, idle=True)
        assert passes == ["idle"]
        collector.between_turns(IDLE_S, idle=True)
        assert passes == ["idle"], "not again within the interval"


def test_a_busy_loop_still_gets_a_full_collection_once_the_longest_interval_is_over() -> None:
    clock, passes = MonotonicClock(1000.0), []
    with Collector(lambda reason, seconds: passes.append(reason), clock) as collector:
        clock.now += MAX_INTERVAL_S - 1
        collector.between_turns(0.0, idle=False)
        assert passes == []
        clock.now += 1
        collector.between_turns(0.0, idle=False)
        assert passes == ["due"]


def test_cycles_that_outlived_the_young_collections_are_freed_by_the_full_one() -> None:
    clock = MonotonicClock(1000.0)

    class Node:
        other: "Node"

    def nodes() -> int:
        return sum(isinstance(o, Node) for o in gc.get_objects())

    with Collector(clock=clock) as collector:
        kept = []
        for _ in range(1000):
            a, b = Node(), Node()
            a.other, b.other = b, a
            kept.append(a)
        del a, b
        gc.collect(1)  # a young pass: the cycles, still referenced, move on to the old generation
        kept.clear()  # now garbage, in the old generation
        gc.collect(1)
        assert nodes() == 2000, "young passes do not visit the old generation"
        clock.now += MAX_INTERVAL_S
        collector.between_turns(0.0, idle=False)
        assert nodes() == 0
