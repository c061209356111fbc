"""Which topics a restart finds removed while the sidecar was down (pure: commits in, topics out),
and which of a drained partition's records cancels and reschedules left owed (pure: facts in)."""

from pathlib import Path

from sidecar.control.cancels import Fact
from sidecar.dispatch.drain import RemovedTopic, TakenBack, holds_pending, removed_while_down
from sidecar.partitions.metadata import CommitMetadata
from sidecar.policy.loader import load_policies
from sidecar.policy.model import PolicySet
from sidecar.tracker.base import pack


def pending_at(earliest: int) -> str:
    return CommitMetadata(earliest=earliest).encode()


def policies(tmp_path: Path) -> PolicySet:
    path = tmp_path / "p.yaml"
    path.write_text("namespaces:\n  pay:\n    topics: 'pay.*'\ntopics:\n  kept: {}\n")
    return load_policies(path)


def test_a_commit_holds_pending_records_only_below_its_offset() -> None:
    assert holds_pending(10, pending_at(3))
    assert not holds_pending(10, pending_at(10))  # earliest at the commit: nothing below it waits
    assert not holds_pending(10, CommitMetadata().encode())
    assert not holds_pending(10, None)
    assert not holds_pending(-1001, pending_at(3))  # no offset committed


def test_only_existing_unserved_topics_with_pending_records_are_removed(tmp_path: Path) -> None:
    commits = {
        ("kept", 0): (10, pending_at(2)),  # still served
        ("gone", 0): (10, pending_at(10)),
        ("gone", 1): (7, pending_at(5)),  # one pending partition is enough
        ("pay.orders", 0): (4, pending_at(0)),
        ("deleted", 0): (9, pending_at(1)),  # no longer in the cluster
        ("idle", 0): (9, None),  # removed, nothing pending: nothing to do
        ("control", 0): (9, pending_at(1)),
    }
    found = removed_while_down(
        commits, {"kept", "control"}, {"kept", "gone", "pay.orders", "idle", "control"}, policies(tmp_path)
    )
    assert found == {
        "gone": RemovedTopic("gone", "gone.dlt", ""),
        "pay.orders": RemovedTopic("pay.orders", "pay.orders.dlt", "pay"),
    }


def test_a_record_is_owed_while_some_subscription_still_has_a_carrier_past_the_watermark() -> None:
    """The drain's reading of facts (TakenBack): a cancel takes a record back from the subscriptions
    it names, a reschedule moves the subscription's carrier to its copy, the latest one counts."""
    through = pack(5_000, 99)  # everything due by 5,000 went out
    taken = TakenBack()
    subs = ("a", "b")
    assert taken.owed(10, 9_000, subs, through)  # untouched and pending
    assert not taken.owed(11, 4_000, subs, through)  # went out before the removal
    taken.add(Fact(10, 200, ((10, "a"), (10, "b"))))  # cancelled for both
    assert not taken.owed(10, 9_000, subs, through)
    taken.add(Fact(12, 201, ((12, "a"),)))  # cancelled for a only: b is still owed it
    assert taken.owed(12, 9_000, subs, through)
    taken.add(Fact(13, 202, ((13, "a"), (13, "b")), 1_000, subs))  # rescheduled early: went out
    assert not taken.owed(13, 9_000, subs, through)
    taken.add(Fact(14, 203, ((14, "a"), (14, "b")), 20_000, subs))  # rescheduled later: its copy pending
    assert taken.owed(14, 3_000, subs, through)  # its own time past, its copy's not
    taken.add(Fact(14, 204, ((203, "a"), (203, "b"))))  # then the copy cancelled
    assert not taken.owed(14, 3_000, subs, through)
    assert taken.owed(15, 9_000, (), through) and not taken.owed(15, 4_000, (), through)  # owed to none: by time
