from sidecar.control.commands import NackCommand
from sidecar.control.nacks import LatestNacks


def nack(offset: int, sub: str = "billing") -> NackCommand:
    return NackCommand(sub, "orders", 0, offset, 1000, None, 0)


def test_latest_command_for_the_same_subscription_and_message_wins() -> None:
    latest = LatestNacks()
    latest.accept(nack(5), (0, 10))
    latest.accept(nack(5), (0, 11))
    latest.accept(nack(5, sub="fraud"), (0, 12))
    assert not latest.claim(nack(5), (0, 10))  # superseded
    assert latest.claim(nack(5), (0, 11))
    assert not latest.claim(nack(5), (0, 11))  # settled once
    assert latest.claim(nack(5, sub="fraud"), (0, 12))
    assert len(latest) == 0


def test_forgetting_a_revoked_control_partition() -> None:
    latest = LatestNacks()
    latest.accept(nack(1), (0, 1))
    latest.accept(nack(2), (1, 1))
    latest.forget_partition(0)
    assert len(latest) == 1 and latest.claim(nack(2), (1, 1))


def test_an_acceptance_written_twice_or_late_does_not_replace_a_later_command() -> None:
    nacks = LatestNacks()
    command = NackCommand("s", "t", 0, 5, 1000, None, 0)
    nacks.accept(command, (1, 10))
    nacks.accept(command, (1, 30))
    nacks.accept(command, (1, 10))  # the first command accepted again after a crash
    assert not nacks.claim(command, (1, 10))
    assert nacks.claim(command, (1, 30))
