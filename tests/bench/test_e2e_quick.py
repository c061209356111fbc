"""Smoke test of the end-to-end benchmark at --quick sizes: it runs, completes and reports.

No timing is asserted: the machine is shared and the sizes are tiny. Every scenario must deliver
every record, and the markdown table and the JSON file must come out.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parents[2]
RUN = [name for name in SCENARIOS if name != "fixed"]
"""Every scenario but `fixed` (fixed delays at full speed; fixed-40k runs the same code): the suite's
time budget."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_delivers_every_record_and_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    # One broker for every scenario: a fresh one each (the full run's way) cost eight JVM starts,
    # most of the test's 230 s in CI.
    argv = ["--quick", "--one-broker", "--plot", "--out", str(out), "--scenarios", ",".join(RUN)]
    done = subprocess.run(
        [sys.executable, "-m", "bench", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| scenario | records |" in done.stdout
    for name in RUN:
        assert f"| {name} |" in done.stdout, done.stdout
    assert "- commit: `" in done.stdout and "- machine: " in done.stdout and "- date: " in done.stdout

    results = json.loads(out.read_text())
    assert [s["name"] for s in results["scenarios"]] == RUN
    for scenario in results["scenarios"]:
        assert scenario["completed"], scenario
        assert all(n == scenario["records"] for n in scenario["delivered"].values()), scenario
        assert scenario["figures"].get("peak_rss_mib"), scenario
    for name in ("delayed", "delayed-small-cache", "fixed-40k", "burst"):
        [scenario] = [s for s in results["scenarios"] if s["name"] == name]
        assert scenario["figures"]["early_records"] == 0, "a record was delivered before its deliver-at"
        assert scenario["figures"]["lateness_read"] == 2 * scenario["records"]
        assert scenario["lateness_series"]["second"], f"{name} has no lateness over time for the chart"
    # Every sidecar scenario is set against both relays, and the targets table comes out of them.
    for scenario in results["scenarios"][2:]:
        assert "x_ceiling" in scenario["figures"] and "x_same_io_relay" in scenario["figures"], scenario
    # The absolute rows only: relative ones need a relay rate, which 30,000 records may not give.
    assert {t["target"].split(":")[0] for t in results["targets"]} >= {"delayed", "delayed-small-cache", "fixed-40k"}
    assert results["table"] in done.stdout
    assert out.with_suffix(".png").exists()
