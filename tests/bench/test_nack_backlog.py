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


def test_a_round_redelivered_within_one_millisecond_has_no_rate() -> None:
    """A chance failure of the smoke test: 300 redeliveries stamped in the same millisecond."""
    row: dict[str, object] = {"due": "past", "nacks_written_s": 0.01, "redelivered": 300, "drain_s": 0.0,
                              "per_second": None, "late_ms": {"min": 1543, "p50": 1543, "p99": 1543, "max": 1543},
                              "sidecar_cpu_s": 0.4}  # fmt: skip
    [_, _, line] = nack_backlog.table([row]).splitlines()
    assert line == "| 1 | past | 0.01 | 300 | 0.0 | - | 1,543 / 1,543 / 1,543 / 1,543 | 0.4 |"
