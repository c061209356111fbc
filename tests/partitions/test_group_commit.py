"""BoundedCommit (sidecar/partitions/group_commit.py): a commit that waits for a coordinator does not
hold the loop, and no second commit overtakes it."""

import threading

import pytest

from sidecar.partitions.group_commit import BoundedCommit, CommitStillWaiting


def test_a_commit_that_gets_no_answer_is_put_off_and_no_other_is_asked_for_until_it_returns() -> None:
    answer, calls = threading.Event(), []
    bounded = BoundedCommit(timeout_s=0.2)
    with pytest.raises(CommitStillWaiting, match="no answer"):
        bounded(lambda: (calls.append("first"), answer.wait(30)))
    with pytest.raises(CommitStillWaiting, match="still waits"):
        bounded(lambda: calls.append("second"))
    assert calls == ["first"], "a later commit would overtake the one still waiting"
    answer.set()
    deadline = threading.Event()
    for _ in range(100):  # the first one returns on its thread
        try:
            bounded(lambda: calls.append("third"))
            break
        except CommitStillWaiting:
            deadline.wait(0.05)
    assert calls == ["first", "third"]


def test_what_the_commit_raises_reaches_the_caller() -> None:
    def fails() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        BoundedCommit(timeout_s=5)(fails)
