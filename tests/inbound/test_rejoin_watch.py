"""When a member that lost its partitions stops waiting for librdkafka to rejoin (inbound/member.py,
over clock.Overdue): the partitions kept lost and the brokers answering is the condition checked."""

from sidecar.inbound.member import REJOIN_MARGIN_S, rejoin_watch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_overdue_once_partitions_stay_lost_for_the_session_and_the_margin_while_the_brokers_answer() -> None:
    clock = Clock()
    watch = rejoin_watch(6_000, clock)
    assert watch.wait_s == 6 + REJOIN_MARGIN_S
    assert not watch.check(True)  # the wait starts
    clock.now += watch.wait_s - 0.1
    assert not watch.check(True)
    clock.now += 0.1
    assert watch.check(True)
    assert watch.check(True)  # until the consumer is made again


def test_the_wait_counts_from_when_the_brokers_answer_again() -> None:
    clock = Clock()
    watch = rejoin_watch(6_000, clock)
    watch.check(True)
    clock.now += 30
    assert not watch.check(False)  # an outage: nobody can rejoin
    clock.now += 100
    assert not watch.check(True)  # back: the whole wait again
    clock.now += watch.wait_s - 1
    assert not watch.check(True)
    clock.now += 1
    assert watch.check(True)


def test_partitions_given_back_or_a_consumer_made_again_start_the_wait_over() -> None:
    clock = Clock()
    watch = rejoin_watch(45_000, clock)
    watch.check(True)
    clock.now += watch.wait_s - 1
    assert not watch.check(False)  # given back
    clock.now += 10
    assert not watch.check(True)  # lost again: a new wait
    clock.now += watch.wait_s
    assert watch.check(True)
    watch.restart()  # made again
    assert not watch.check(True)
    clock.now += watch.wait_s - 1
    assert not watch.check(True)
