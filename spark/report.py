"""What the audit shows a person: the summary table, the thresholds verdict and the lateness chart."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import matplotlib

matplotlib.use("Agg")  # no display: the chart is a file
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from spark.audit import AuditResult
    from spark.settings import AuditSettings

COLUMNS = [
    ("topic", "topic"),
    ("subscription", "subscription"),
    ("inbound", "inbound"),
    ("rejected", "rejected"),
    ("accepted", "accepted"),
    ("delivered", "delivered"),
    ("pending", "pending"),
    ("missing", "missing"),
    ("duplicates", "dup"),
    ("early", "early"),
    ("late", "late"),
    ("lateness_p50_ms", "p50 ms"),
    ("lateness_p95_ms", "p95 ms"),
    ("lateness_p99_ms", "p99 ms"),
    ("lateness_max_ms", "max ms"),
    ("redelivered", "redeliv"),
    ("redelivery_lateness_p99_ms", "redeliv p99"),
    ("nacks", "nacks"),
    ("nacks_missing", "nack miss"),
]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if math.isfinite(value) else str(value)
    return str(value)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def thresholds_report(result: AuditResult, settings: AuditSettings) -> tuple[dict[str, dict[str, int]], bool]:
    """Each threshold's limit and actual count; the audit passes when none is exceeded (-1: no limit)."""
    c = result.anomaly_counts
    actual = {
        "missing": c["missing"] + c["nack_missing"],
        "duplicates": c["duplicate"] + c["rejected_and_delivered"],
        "early": c["early"],
        "late": c["late"],
    }
    limits = {
        "missing": settings.max_missing,
        "duplicates": settings.max_duplicates,
        "early": settings.max_early,
        "late": settings.max_late,
    }
    report = {
        name: {"limit": limits[name], "actual": actual[name], "exceeded": 0 <= limits[name] < actual[name]}
        for name in limits
    }
    return report, not any(v["exceeded"] for v in report.values())


def print_summary(result: AuditResult, report: dict[str, Any], show: int, out: TextIO) -> None:
    rows = [[_cell(getattr(s, name)) for name, _ in COLUMNS] for s in result.subscriptions]
    out.write("Delivery audit per topic and subscription (lateness of first deliveries)\n")
    out.write(table(rows, [title for _, title in COLUMNS]) + "\n\n")
    if result.rejections:
        out.write("Rejections (dead-letter topics)\n")
        out.write(
            table([[r["topic"], r["code"], str(r["count"])] for r in result.rejections], ["topic", "code", "count"])
        )
        out.write("\n\n")
    if result.control_rejections:
        out.write("Refused nack commands (control dead-letter topic)\n")
        out.write(table([[r["code"], str(r["count"])] for r in result.control_rejections], ["code", "count"]) + "\n\n")
    total = sum(result.anomaly_counts.values())
    if total and show:
        out.write(f"Anomalies (first {min(show, total)} of {total}; all in {report['outputs']['anomalies']})\n")
        fields = ["kind", "topic", "partition", "offset", "subscription", "redelivery_count", "outbound_topic"]
        fields += ["outbound_partition", "outbound_offset", "detail"]
        rows = [
            [_cell(r[f]) for f in fields]
            for r in result.anomalies.orderBy("kind", "topic", "partition", "offset", "subscription")
            .limit(show)
            .collect()
        ]
        out.write(table(rows, fields) + "\n\n")
    verdict = []
    for name, t in report["thresholds"].items():
        limit = "no limit" if t["limit"] < 0 else f"max {t['limit']}"
        verdict.append(f"{name} {t['actual']} ({limit}{', EXCEEDED' if t['exceeded'] else ''})")
    out.write(("PASS: " if report["passed"] else "FAIL: ") + "; ".join(verdict) + "\n")
    out.write(f"Report: {report['outputs']['chart'].rsplit('/', 1)[0]}/report.json\n")
    out.flush()


def write_chart(result: AuditResult, path: Path) -> None:
    """Lateness percentiles of first deliveries per subscription (and of nack redeliveries), a PNG."""
    subs = [s for s in result.subscriptions if s.delivered or s.redelivered]
    labels = [f"{s.topic}\n{s.subscription}" for s in subs]
    series: list[tuple[str, list[float | int | None]]] = [
        ("p50", [s.lateness_p50_ms for s in subs]),
        ("p95", [s.lateness_p95_ms for s in subs]),
        ("p99", [s.lateness_p99_ms for s in subs]),
        ("max", [s.lateness_max_ms for s in subs]),
        ("redelivery p99", [s.redelivery_lateness_p99_ms for s in subs]),
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(subs) + 2), 4.5))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        xs = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(subs))]
        ax.bar(xs, [max(float(v), 0.0) if v is not None else 0.0 for v in values], width, label=name)
    ax.set_xticks(range(len(subs)), labels, fontsize=8)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylabel("lateness (ms after deliver-at)")
    ax.set_title("Delivery lateness per subscription" if subs else "Delivery lateness: nothing delivered")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
