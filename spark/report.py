"""What the audit shows a person: the summary table, the thresholds verdict, the chart and an HTML page.

The chart answers "when": lateness per subscription and anomalies per kind, over the inbound
records' publish time, so a bad hour stands out from a bad day.
"""

from __future__ import annotations

import base64
import html
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import matplotlib

matplotlib.use("Agg")  # no display: the chart is a file
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from spark.model import AuditResult
    from spark.settings import AuditSettings

ANOMALY_FIELDS = [
    "kind",
    "topic",
    "partition",
    "offset",
    "subscription",
    "redelivery_count",
    "outbound_topic",
    "outbound_partition",
    "outbound_offset",
    "detail",
]

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
    ("out_of_order", "order"),
    ("wrong_partition", "wrong part"),
    ("lateness_p50_ms", "p50 ms"),
    ("lateness_p95_ms", "p95 ms"),
    ("lateness_p99_ms", "p99 ms"),
    ("lateness_max_ms", "max ms"),
    ("redelivered", "redeliv"),
    ("redelivery_lateness_p99_ms", "redeliv p99"),
    ("nacks", "nacks"),
    ("nacks_missing", "nack miss"),
    ("cancelled", "cancelled"),
    ("rescheduled", "resched"),
    ("delivered_after_cancel", "deliv+cancel"),
    ("rescheduled_early", "resched early"),
    ("replaced", "replaced"),
    ("delivered_replaced", "deliv+replaced"),
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
        # Delivered where nothing was owed: dead-lettered, cancelled (contract section 5), or
        # replaced by its key's newer record (section 2).
        "duplicates": c["duplicate"]
        + c["rejected_and_delivered"]
        + c["delivered_after_cancel"]
        + c["delivered_replaced"],
        "early": c["early"] + c["rescheduled_early"],
        "late": c["late"],
        # A record off its inbound partition's number is out of that partition's order too.
        "out_of_order": c["out_of_order"] + c["wrong_partition"],
    }
    limits = {
        "missing": settings.max_missing,
        "duplicates": settings.max_duplicates,
        "early": settings.max_early,
        "late": settings.max_late,
        "out_of_order": settings.max_out_of_order,
    }
    report = {
        name: {"limit": limits[name], "actual": actual[name], "exceeded": 0 <= limits[name] < actual[name]}
        for name in limits
    }
    return report, not any(v["exceeded"] for v in report.values())


def anomaly_rows(result: AuditResult, show: int) -> list[dict[str, Any]]:
    """The first `show` anomalies in a stable order, for the summary and the HTML page."""
    if not show or not sum(result.anomaly_counts.values()):
        return []
    ordered = result.anomalies.orderBy("kind", "topic", "partition", "offset", "subscription", "outbound_offset")
    return [r.asDict() for r in ordered.limit(show).collect()]


def print_summary(result: AuditResult, report: dict[str, Any], shown: list[dict[str, Any]], out: TextIO) -> None:
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
    if shown:
        out.write(f"Anomalies (first {len(shown)} of {total}; all in {report['outputs']['anomalies']})\n")
        out.write(table([[_cell(r[f]) for f in ANOMALY_FIELDS] for r in shown], ANOMALY_FIELDS) + "\n\n")
    out.write(f"Kafka source: {report['source']}\n")
    out.write(("PASS: " if report["passed"] else "FAIL: ") + verdict(report) + "\n")
    out.write(f"Report: {report['outputs']['report']} and {report['outputs']['html']}\n")
    out.flush()


def verdict(report: dict[str, Any]) -> str:
    parts = []
    for name, t in report["thresholds"].items():
        limit = "no limit" if t["limit"] < 0 else f"max {t['limit']}"
        parts.append(f"{name} {t['actual']} ({limit}{', EXCEEDED' if t['exceeded'] else ''})")
    return "; ".join(parts)


KIND_COLOURS = {
    "missing": "tab:red",
    "nack_missing": "tab:purple",
    "duplicate": "tab:orange",
    "rejected_and_delivered": "tab:brown",
    "early": "tab:pink",
    "late": "tab:olive",
    "out_of_order": "tab:cyan",
    "wrong_partition": "tab:blue",
}


def _when(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def write_chart(result: AuditResult, path: Path) -> None:
    """Three panels, a PNG: lateness percentiles per subscription; lateness p99 per subscription over
    time; anomalies per kind over time (both by the inbound records' publish time)."""
    subs = [s for s in result.subscriptions if s.delivered or s.redelivered]
    labels = [f"{s.topic}\n{s.subscription}" for s in subs]
    series: list[tuple[str, list[float | int | None]]] = [
        ("p50", [s.lateness_p50_ms for s in subs]),
        ("p95", [s.lateness_p95_ms for s in subs]),
        ("p99", [s.lateness_p99_ms for s in subs]),
        ("max", [s.lateness_max_ms for s in subs]),
        ("redelivery p99", [s.redelivery_lateness_p99_ms for s in subs]),
    ]
    fig, (bars, over_time, kinds) = plt.subplots(3, 1, figsize=(max(8.0, 1.4 * len(subs) + 2), 12))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        xs = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(subs))]
        bars.bar(xs, [max(float(v), 0.0) if v is not None else 0.0 for v in values], width, label=name)
    bars.set_xticks(range(len(subs)), labels, fontsize=8)
    bars.set_yscale("symlog", linthresh=10)
    bars.set_ylabel("lateness (ms after deliver-at)")
    bars.set_title("Delivery lateness per subscription" if subs else "Delivery lateness: nothing delivered")
    bars.legend(fontsize=8)
    bars.grid(axis="y", alpha=0.3)

    timeline = result.timeline
    by_sub: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in timeline.lateness if timeline else []:
        by_sub.setdefault((row["topic"], row["subscription"]), []).append(row)
    for (topic, sub), rows in sorted(by_sub.items()):
        over_time.plot(
            [_when(r["bucket_ms"]) for r in rows], [max(r["p99_ms"], 0.0) for r in rows], label=f"{topic}/{sub}"
        )
    over_time.set_yscale("symlog", linthresh=10)
    over_time.set_ylabel("lateness p99 (ms)")
    bucket = f"{timeline.bucket_ms // 1000} s buckets" if timeline else ""
    over_time.set_title(f"Lateness p99 per subscription over publish time ({bucket})")
    if by_sub:
        over_time.legend(fontsize=7, ncol=2)
    over_time.grid(alpha=0.3)

    by_kind: dict[str, list[dict[str, Any]]] = {}
    for row in timeline.anomalies if timeline else []:
        by_kind.setdefault(row["kind"], []).append(row)
    bar_days = (timeline.bucket_ms if timeline else 1000) / 86_400_000 * 0.9
    bottoms: dict[int, int] = {}
    for kind, rows in sorted(by_kind.items()):
        base = [bottoms.get(r["bucket_ms"], 0) for r in rows]
        kinds.bar(
            [_when(r["bucket_ms"]) for r in rows],
            [r["count"] for r in rows],
            bar_days,
            bottom=base,
            label=kind,
            color=KIND_COLOURS.get(kind),
            align="edge",
        )
        for r in rows:
            bottoms[r["bucket_ms"]] = bottoms.get(r["bucket_ms"], 0) + r["count"]
    kinds.set_ylabel("anomalies")
    kinds.set_title("Anomalies per kind over publish time" if by_kind else "Anomalies over time: none")
    if by_kind:
        kinds.legend(fontsize=8)
    kinds.grid(axis="y", alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_html(result: AuditResult, report: dict[str, Any], shown: list[dict[str, Any]], path: Path) -> None:
    """One self-contained page (the chart inlined) to attach to a ticket or open from CI artifacts."""

    def rows_html(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    chart = Path(report["outputs"]["chart"])
    image = ""
    if chart.is_file():
        encoded = base64.b64encode(chart.read_bytes()).decode()
        image = f'<img alt="lateness and anomalies over time" src="data:image/png;base64,{encoded}">'
    summary = rows_html(
        [title for _, title in COLUMNS],
        [[_cell(getattr(s, name)) for name, _ in COLUMNS] for s in result.subscriptions],
    )
    anomalies = rows_html(ANOMALY_FIELDS, [[_cell(r[f]) for f in ANOMALY_FIELDS] for r in shown]) if shown else ""
    status = "PASS" if report["passed"] else "FAIL"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>delay-sidecar audit: {status}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}th{{background:#eee}}
.FAIL{{color:#b00}}.PASS{{color:#070}}</style></head><body>
<h1 class="{status}">{status}</h1><p>{html.escape(verdict(report))}</p>
<p>Source: {html.escape(str(report["source"]))}; wall time {report["wall_time_s"]} s;
records read: {html.escape(json_line(result.records_read))}</p>
<h2>Per topic and subscription</h2>{summary}
<h2>Over time</h2>{image}
<h2>Anomalies (first {len(shown)} of {sum(result.anomaly_counts.values())})</h2>{anomalies}
<p>Every anomaly is in {html.escape(report["outputs"]["anomalies"])} (Parquet); the numbers in
{html.escape(report["outputs"]["report"])}.</p>
</body></html>
"""
    path.write_text(page)


def json_line(values: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in values.items())
