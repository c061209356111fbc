"""Smoke test of bench/group_join.py at one round: the two members join and the table comes out.
Whether the broker wedges is its behaviour (noida-db did; docs/benchmarks.md), not asserted."""

import pytest

from bench import group_join


@pytest.mark.slow
def test_one_round_of_two_joins_prints_its_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert group_join.main(["--gaps", "1.5", "--rounds", "1", "--wait-s", "30"]) == 0
    table = capsys.readouterr().out
    assert "| gap (s) | rounds |" in table
    [row] = [line for line in table.splitlines() if line.startswith("| 1.50 |")]
    assert row.startswith("| 1.50 | 1 |")
