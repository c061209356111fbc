"""The run's environment, the markdown table, the targets, the JSON file and the lateness chart."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import confluent_kafka

from bench.scenarios import Result

ROOT = Path(__file__).resolve().parents[1]

TARGET_PASSTHROUGH = 0.8
TARGET_DELAYED = 0.5
TARGET_P99_MS = 50.0
TARGET_P99_DUE_RATE = 10_000
TARGET_DRAIN_S = 10.0


def environment(bootstrap: str, command: str) -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
        "command": command,
        "broker": f"noida-db {_version('noida-db')} (embedded, {bootstrap})",
        "cores": os.cpu_count(),
        "cpu": cpu,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "confluent_kafka": confluent_kafka.version()[0],
        "librdkafka": confluent_kafka.libversion()[0],
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def targets(results: list[Result]) -> list[dict[str, Any]]:
    by_name = {r.name: r.figures for r in results}
    out: list[dict[str, Any]] = []
    if "passthrough" in by_name and by_name["passthrough"].get("x_ceiling") is not None:
        x = by_name["passthrough"]["x_ceiling"]
        out.append(_target(f"pass-through >= {TARGET_PASSTHROUGH}x ceiling", f"{x:.2f}x", x >= TARGET_PASSTHROUGH))
    if "burst" in by_name and by_name["burst"].get("x_ceiling") is not None:
        # The delayed scenario delivers at the rate records fall due; the burst shows the capacity.
        x = by_name["burst"]["x_ceiling"]
        out.append(
            _target(f"delayed delivery >= {TARGET_DELAYED}x ceiling (burst drain)", f"{x:.2f}x", x >= TARGET_DELAYED)
        )
    for name in ("delayed", "fixed"):
        figures = by_name.get(name, {})
        p99, due_rate = figures.get("lateness_p99_ms"), figures.get("due_rate")
        if p99 is not None and due_rate:
            label = f"{name}: lateness p99 <= {TARGET_P99_MS:.0f} ms at {TARGET_P99_DUE_RATE:,} due/s"
            measured = f"{p99:.0f} ms at {due_rate:,.0f} due/s"
            out.append(_target(label, measured, p99 <= TARGET_P99_MS if due_rate >= TARGET_P99_DUE_RATE else None))
    drain = by_name.get("burst", {}).get("drain_s")
    if drain is not None:
        records = next(r.records for r in results if r.name == "burst")
        out.append(_target(f"burst of {records:,} drained <= {TARGET_DRAIN_S:.0f} s", f"{drain:.1f} s", drain <= 10))
    return out


def _target(name: str, measured: str, met: bool | None) -> dict[str, Any]:
    return {"target": name, "measured": measured, "met": met}


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}{suffix}"
    return f"{int(value):,}{suffix}"


def markdown(env: dict[str, Any], results: list[Result]) -> str:
    lines = [
        f"- date: {env['date']}",
        f"- commit: `{env['commit']}`",
        f"- command: `{env['command']}`",
        f"- broker: {env['broker']}",
        f"- machine: {env['cores']} cores, {env['cpu']}, load average at start "
        f"{' / '.join(str(x) for x in env['load_average_at_start'])} (shared machine: compare ratios, not absolutes)",
        f"- python {env['python']}, confluent-kafka {env['confluent_kafka']}, librdkafka {env['librdkafka']}",
        "",
        "| scenario | records | subs | index rate (rec/s) | delivery rate (rec/s per sub) | x ceiling "
        "| lateness p50 / p99 / max (ms) | drain (s) | peak RSS (MiB) | all delivered |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        f = r.figures
        lateness = (
            f"{_fmt(f.get('lateness_p50_ms'))} / {_fmt(f.get('lateness_p99_ms'))} / {_fmt(f.get('lateness_max_ms'))}"
            if f.get("lateness_p99_ms") is not None
            else "-"
        )
        x = f.get("x_ceiling")
        lines.append(
            f"| {r.name} | {r.records:,} | {r.subscriptions} | {_fmt(f.get('index_rate'))} "
            f"| {_fmt(f.get('delivery_rate_per_sub'))} | {'-' if x is None else f'{x:.2f}'} | {lateness} "
            f"| {_fmt(f.get('drain_s'))} | {_fmt(f.get('peak_rss_mib'))} | {'yes' if r.completed else 'NO'} |"
        )
    checks = targets(results)
    if checks:
        lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
        for t in checks:
            met = {True: "yes", False: "**no**", None: "n/a (due rate below the target's)"}[t["met"]]
            lines.append(f"| {t['target']} | {t['measured']} | {met} |")
    notes = [f"- {r.name}: {note}" for r in results for note in r.notes]
    extras = [
        f"- {r.name}: "
        + ", ".join(
            f"{k}={v}"
            for k, v in r.figures.items()
            if k
            in {
                "produce_rate",
                "startup_s",
                "due_rate",
                "delivery_peak_1s_per_sub",
                "delivery_span_s",
                "indexed_before_due",
                "early_records",
                "window_s",
                "fixed_delay_s",
                "payload_reads_cache",
                "payload_reads_log",
                "cache_counted_peak_mib",
                "cache_disk_peak_mib",
            }
        )
        for r in results
    ]
    lines += ["", "Details:", *extras, *notes]
    return "\n".join(lines)


def write_json(path: Path, env: dict[str, Any], results: list[Result], table: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": env,
        "scenarios": [r.as_json() for r in results],
        "targets": targets(results),
        "table": table,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


def plot(path: Path, results: list[Result]) -> bool:
    """Lateness (p50, p99, max per second of deliver-at) over time, one panel per delayed scenario."""
    panels = [r for r in results if r.series.get("second")]
    if not panels:
        return False
    import matplotlib  # noqa: PLC0415 - only --plot needs it, and it is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for ax, r in zip(axes[:, 0], panels, strict=True):
        s = r.series
        for key, style in (("max_ms", ":"), ("p99_ms", "-"), ("p50_ms", "--")):
            ax.plot(s["second"], s[key], style, label=key.removesuffix("_ms"))
        ax.axhline(TARGET_P99_MS, color="red", linewidth=0.8, label=f"{TARGET_P99_MS:.0f} ms")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_title(f"{r.name}: {r.records:,} records")
        ax.set_xlabel("seconds since the first deliver-at")
        ax.set_ylabel("lateness (ms)")
        ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
