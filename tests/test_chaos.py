"""The short chaos run (bench/chaos.py): kill -9 three times and one zombie while records fall due
and a consumer nacks 5% of them, in exactly-once mode, then count every record read_committed.

The full run (20 kills, a deleted state dir, a broker restart) is `python -m bench.chaos`; its
result is in docs/reliability.md.
"""

from pathlib import Path

from bench.chaos import Plan, run, table


def test_three_kills_and_a_zombie_lose_duplicate_and_advance_nothing(tmp_path: Path) -> None:
    plan = Plan(records=3_000, kills=3, window_s=12.0, seed=3, broker_restart=False, state_loss=False, zombie=True)
    outcome = run(plan, tmp_path)
    print(table(outcome, "tests/test_chaos.py"))
    audit = outcome.audit
    assert not outcome.notes, outcome.notes
    assert outcome.kills == 3 and outcome.zombie_fenced, table(outcome, "")
    assert audit.lost == {"shared": 0, "excl": 0}, audit
    assert audit.duplicated == {"shared": 0, "excl": 0}, audit
    assert audit.early == {"shared": 0, "excl": 0}, audit
    assert audit.nacks_sent > 0 and audit.nacks_redelivered == audit.nacks_sent, audit
    assert audit.redeliveries_unasked == 0, audit
