"""Which topics a restart finds removed while the sidecar was down (pure: commits in, topics out)."""

from pathlib import Path

from sidecar.dispatch.drain import RemovedTopic, holds_pending, removed_while_down
from sidecar.partitions.metadata import CommitMetadata
from sidecar.policy.loader import load_policies
from sidecar.policy.model import PolicySet


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
