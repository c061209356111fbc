"""Smoke test of bench/cache_cost.py: a small run writes, reads everything back and prints its row. No broker."""

import pytest

from bench import cache_cost


def test_a_small_run_prints_the_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert cache_cost.main(["--records", "3000", "--partitions", "2", "--spread-s", "2", "--rounds", "2"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3,000 |")]
    per_entry, add, write, read = (float(cell) for cell in row.strip("| ").split(" | ")[3:7])
    # 1,500 records per partition in one slice over 20 slots of 2 s: about 75 records per entry.
    assert 20 <= per_entry <= 150
    assert add > 0 and write > 0 and read > 0


def test_one_record_per_slot_gives_one_record_per_entry() -> None:
    data = cache_cost.records(400, partitions=1, spread_s=400, seed=3)
    # Slices of one record: each write holds one entry per record.
    assert cache_cost.measure(data, slice_size=1).per_entry == 1.0
