"""Smoke test of bench/send_cost.py: a few small rounds, and its one row comes out. No broker."""

import pytest

from bench import send_cost


def test_a_few_rounds_print_the_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert send_cost.main(["--records", "200", "--rounds", "3"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 200 |")]
    best, median = (float(cell) for cell in row.strip("| ").split(" | ")[3:5])
    assert 0 < best <= median
