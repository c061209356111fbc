"""Smoke test of bench/nack_backlog.py at a tiny size: each way of falling due runs, every nack comes
back and the table comes out. No timing is asserted (the figures go in docs/benchmarks.md)."""

import pytest

from bench import nack_backlog


@pytest.mark.slow
@pytest.mark.parametrize("due", ["past", "live"])
def test_every_nack_of_the_backlog_comes_back_and_the_table_is_printed(
    due: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert nack_backlog.main(["--messages", "300", "--rounds", "1", "--due", due, "--timeout-s", "120"]) == 0
    table = capsys.readouterr().out
    assert "| round | due |" in table
    [row] = [line for line in table.splitlines() if line.startswith("| 1 |")]
    assert f"| {due} |" in row and "| 300 |" in row
