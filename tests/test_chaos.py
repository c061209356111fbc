"""The short chaos run (bench/chaos.py): kill -9 three times and one zombie while records fall due,
in exactly-once mode, then count every record of both subscriptions read_committed.

The full run (20 kills, a deleted state dir, a broker restart) is `python -m bench.chaos`; its
result is in docs/reliability.md.
"""

from pathlib import Path

from bench.chaos import Outcome, Plan, run, table


def assert_clean(outcome: Outcome) -> None:
    audit, report = outcome.audit, table(outcome, "tests/test_chaos.py")
    assert not outcome.notes, report
    assert outcome.kills == 3 and outcome.zombie_fenced, report
    assert audit.lost == {"shared": 0, "excl": 0}, report
    assert audit.duplicated == {"shared": 0, "excl": 0}, report
    assert audit.early == {"shared": 0, "excl": 0}, report
    assert audit.nacks_redelivered == audit.nacks_sent and audit.redeliveries_unasked == 0, report


def test_three_kills_and_a_zombie_lose_duplicate_and_advance_nothing(tmp_path: Path) -> None:
    outcome = run(Plan(records=3_000, kills=3, window_s=12.0, seed=3, broker_restart=False, state_loss=False,
                       nack_fraction=0.0), tmp_path)  # fmt: skip
    print(table(outcome, "tests/test_chaos.py"))
    assert_clean(outcome)


def test_with_nacks_every_accepted_nack_comes_back_once(tmp_path: Path) -> None:
    """Was xfail on noida-db: its read_committed fetches drop a producer id's commits after that
    id's abort (tests/broker/test_transactions.py), and the sidecar wrote under one producer id
    across kills, so its own reader of the control topic lost accepted nacks (7 of 142). Each
    producer now has a transactional.id, so a producer id, of its own (sidecar/identity.py)."""
    outcome = run(Plan(records=3_000, kills=3, window_s=12.0, seed=3, broker_restart=False, state_loss=False),
                  tmp_path)  # fmt: skip
    print(table(outcome, "tests/test_chaos.py"))
    assert outcome.audit.nacks_sent > 0
    assert_clean(outcome)
