from sidecar.control.commands import AcceptedNack, NackCommand
from sidecar.control.nacks import LatestNacks
from sidecar.tracker.base import pack

C0, C1 = ("control", 0), ("control", 1)


def nack(
    offset: int, position: tuple[int, int], sub: str = "billing", deliver_at: int = 5_000, control: str = "control"
) -> AcceptedNack:
    """A nack accepted at `position`: (partition, offset) of the command in `control`."""
    return AcceptedNack(NackCommand(sub, "orders", 0, offset, 1000, None, 0), deliver_at, (control, *position))


def test_latest_command_for_the_same_subscription_and_message_wins() -> None:
    latest = LatestNacks()
    latest.accept(nack(5, (0, 10)), 100)
    latest.accept(nack(5, (0, 11)), 101)
    latest.accept(nack(5, (0, 12), sub="fraud"), 102)
    assert not latest.claim(nack(5, (0, 10)), 100)  # superseded
    assert latest.claim(nack(5, (0, 11)), 101)
    assert not latest.claim(nack(5, (0, 11)), 101)  # settled once
    assert latest.claim(nack(5, (0, 12), sub="fraud"), 102)
    assert len(latest) == 0


def test_forgetting_a_revoked_control_partition() -> None:
    latest = LatestNacks(changelog=True)
    latest.accept(nack(1, (0, 1)), 2)
    latest.accept(nack(2, (1, 1)), 2)
    latest.forget_partition(C0)
    assert len(latest) == 1 and latest.claim(nack(2, (1, 1)), 2)
    assert latest.take(C0, 0) == ([], [])  # its changes are the new owner's to write


def test_an_acceptance_written_twice_or_late_does_not_replace_a_later_command() -> None:
    nacks = LatestNacks()
    nacks.accept(nack(5, (1, 10)), 11)
    nacks.accept(nack(5, (1, 30)), 31)
    nacks.accept(nack(5, (1, 10)), 32)  # the first command accepted again after a crash
    assert not nacks.claim(nack(5, (1, 10)), 11)
    assert nacks.claim(nack(5, (1, 30)), 31)


def test_without_a_state_topic_no_changes_are_kept() -> None:
    nacks = LatestNacks()
    nacks.accept(nack(5, (0, 10)), 11)
    assert nacks.claim(nack(5, (0, 10)), 11)
    assert nacks.take(C0, pack(10**12, 0)) == ([], [])


def test_the_changelog_writes_a_pending_nack_and_tombstones_it_once_a_commit_covers_it() -> None:
    nacks = LatestNacks(changelog=True)
    first = nack(5, (0, 10))
    nacks.accept(first, 11)
    nacks.accept(first, 11)  # read again (a replay): nothing new
    assert nacks.take(C0, -1) == ([((11, "billing"), first.encode())], [])
    assert nacks.claim(first, 11)
    assert nacks.take(C0, pack(first.deliver_at, 11) - 1) == ([], [])  # not covered by the commit yet
    assert nacks.take(C0, pack(first.deliver_at, 11)) == ([], [(11, "billing")])
    assert nacks.take(C0, pack(first.deliver_at, 11)) == ([], [])


def test_a_superseded_nack_is_tombstoned_at_once_after_the_one_that_replaces_it() -> None:
    nacks = LatestNacks(changelog=True)
    older, newer = nack(5, (0, 10)), nack(5, (0, 20), deliver_at=9_000)
    nacks.accept(older, 11)
    nacks.take(C0, -1)
    nacks.accept(newer, 21)
    assert nacks.take(C0, -1) == ([((21, "billing"), newer.encode())], [(11, "billing")])
    # An older command read after a later one (accepted late) is never written.
    nacks.accept(nack(5, (0, 15)), 22)
    assert nacks.take(C0, -1) == ([], [(22, "billing")])


def test_an_acceptance_written_twice_keeps_only_its_first_copy() -> None:
    nacks = LatestNacks(changelog=True)
    accepted = nack(5, (0, 10))
    nacks.accept(accepted, 11)
    nacks.accept(accepted, 12)
    assert nacks.take(C0, -1) == ([((11, "billing"), accepted.encode())], [(12, "billing")])


def test_a_restored_nack_is_not_written_again_but_can_be_superseded() -> None:
    nacks = LatestNacks(changelog=True)
    restored = nack(5, (0, 10))
    nacks.restore(restored, 11)
    nacks.accept(restored, 11)  # the tail of the control log read again
    assert nacks.take(C0, -1) == ([], [])
    newer = nack(5, (0, 30))
    nacks.accept(newer, 31)
    assert nacks.take(C0, -1) == ([((31, "billing"), newer.encode())], [(11, "billing")])
    assert not nacks.claim(restored, 11) and nacks.claim(newer, 31)


def test_control_topics_with_the_same_partition_numbers_are_kept_apart() -> None:
    latest = LatestNacks(changelog=True)
    payments, orders = nack(1, (0, 7), control="payments.control"), nack(2, (0, 7))
    latest.accept(payments, 8)
    latest.accept(orders, 8)
    latest.forget_partition(C0)
    assert len(latest) == 1 and latest.take(("payments.control", 0), -1) == ([((8, "billing"), payments.encode())], [])
    assert not latest.claim(orders, 8) and latest.claim(payments, 8)


def test_a_cancelled_acceptance_is_no_pending_nack_even_before_it_is_settled() -> None:
    latest = LatestNacks()
    latest.accept(nack(5, (0, 10), deliver_at=9_000), 10)
    assert latest.pending_for("orders", 0, 5, ["billing", "fraud"]) == {"billing": (9_000, 1)}
    cancel = AcceptedNack(NackCommand("billing", "orders", 0, 5, None, 6_000, 0), 6_000, ("control", 0, 11), True)
    latest.accept(cancel, 11)
    assert latest.pending_for("orders", 0, 5, ["billing"]) == {}
    assert not latest.claim(nack(5, (0, 10), deliver_at=9_000), 10) and latest.claim(cancel, 11)


def test_a_reschedule_moving_two_subscriptions_nacks_keeps_an_entry_for_each() -> None:
    """One index offset, two acceptances: each is written, superseded and found on its own."""
    latest = LatestNacks(changelog=True)
    latest.accept(nack(5, (0, 10)), 10)
    latest.accept(nack(5, (0, 11), sub="fraud"), 11)
    latest.take(C0, -1)
    moved = [nack(5, (0, 20), deliver_at=9_000), nack(5, (0, 20), sub="fraud", deliver_at=9_000)]
    for accepted in moved:
        latest.accept(accepted, 20)
    upserts, dead = latest.take(C0, -1)
    assert [entry for entry, _ in upserts] == [(20, "billing"), (20, "fraud")]
    assert dead == [(10, "billing"), (11, "fraud")]
    latest.accept(nack(5, (0, 30)), 30)  # billing nacked again: only billing's moved nack goes
    assert latest.take(C0, -1) == ([((30, "billing"), nack(5, (0, 30)).encode())], [(20, "billing")])
    [found] = latest.settle_due("control", 0, 20)
    assert (found.command.message_key, found.deliver_at, found.source) == (
        moved[1].command.message_key,
        9_000,
        moved[1].source,
    )


def test_a_due_index_entry_stands_for_the_nacks_in_force_there_and_no_others() -> None:
    """What Redelivery redelivers for an entry it pops: nothing once superseded or settled."""
    latest = LatestNacks()
    assert not latest.accept(nack(5, (0, 10)), 10)
    assert latest.accept(nack(5, (0, 11)), 11), "supersedes a pending nack"
    assert not latest.accept(nack(6, (0, 12)), 12)
    assert latest.settle_due("control", 0, 10) == []
    [due] = latest.settle_due("control", 0, 11)
    assert (due.command.offset, due.source, due.deliver_at) == (5, ("control", 0, 11), 5_000)
    assert not latest.claim(due, 11) and latest.settle_due("control", 0, 11) == [], "settled once"
    assert latest.pending_for("orders", 0, 5, ["billing"]) == {}
    cancel = AcceptedNack(NackCommand("billing", "orders", 0, 6, None, 6_000, 0), 6_000, ("control", 0, 13), True)
    assert latest.accept(cancel, 13)
    assert not latest.accept(nack(6, (0, 14)), 14), "a cancelled acceptance is no pending nack"
    latest.forget_partition(C0)
    assert latest.settle_due("control", 0, 14) == [] and len(latest) == 0


def test_a_nack_settled_before_any_checkpoint_wrote_it_is_never_written() -> None:
    """Neither its entry nor a tombstone: the state topic never held it. One written before it was
    settled is still tombstoned once a commit covers it."""
    nacks = LatestNacks(changelog=True)
    quick, slow = nack(5, (0, 10)), nack(6, (0, 11))
    nacks.accept(quick, 10)
    nacks.accept(slow, 11)
    assert nacks.claim(quick, 10)
    assert nacks.take(C0, -1) == ([((11, "billing"), slow.encode())], [])
    assert nacks.claim(slow, 11)
    assert nacks.take(C0, pack(10**12, 0)) == ([], [(11, "billing")])


def test_settling_a_due_entry_keeps_the_changelog_as_claiming_does() -> None:
    """settle_due is what Redelivery settles a popped entry with: the same changelog as `claim`,
    one entry per subscription indexed at that offset, cancelled acceptances included."""
    nacks = LatestNacks(changelog=True)
    written, quick = nack(5, (0, 10)), nack(6, (0, 10), sub="fraud")
    nacks.accept(written, 10)
    assert nacks.take(C0, -1) == ([((10, "billing"), written.encode())], [])
    nacks.accept(quick, 10)
    cancel = AcceptedNack(NackCommand("billing", "orders", 0, 7, None, 6_000, 0), 6_000, ("control", 0, 12), True)
    nacks.accept(nack(7, (0, 11)), 11)
    nacks.accept(cancel, 12)
    settled = nacks.settle_due("control", 0, 10)
    assert sorted(_named(n) for n in settled) == sorted(_named(n) for n in (written, quick)) and len(nacks) == 1
    [cancelled] = nacks.settle_due("control", 0, 12)
    assert _named(cancelled) == _named(cancel) and len(nacks) == 0
    # The written one is marked dead once a commit covers it; the others were never written, and
    # need nothing (11 was superseded by the cancel at 12 before any checkpoint took it).
    assert nacks.take(C0, -1) == ([], [])
    assert nacks.take(C0, pack(10**12, 0)) == ([], [(10, "billing")])


def _named(accepted: AcceptedNack) -> tuple[object, ...]:
    """What identifies an acceptance and what it redelivers (the command's delay is spent by then)."""
    c = accepted.command
    return (c.message_key, c.redelivery_count, accepted.deliver_at, accepted.source, accepted.cancelled)
