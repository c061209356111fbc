"""The report's "when": lateness and anomalies by bucket of publish time, the series of the chart.

Apart from the analysis because it judges nothing: it only groups what the analysis found.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F  # noqa: N812

from spark.model import Timeline

BUCKETS_MS = [1_000, 10_000, 60_000, 300_000, 900_000, 3_600_000, 21_600_000, 86_400_000, 7 * 86_400_000]


def bucket_width(span_ms: int, buckets: int = 60) -> int:
    """The smallest round width that shows `span_ms` in at most about `buckets` bars."""
    for width in BUCKETS_MS:
        if span_ms <= width * buckets:
            return width
    return BUCKETS_MS[-1]


def build_timeline(audited: DataFrame, anomalies: DataFrame, span: tuple[int | None, int | None]) -> Timeline:
    """Lateness per subscription and anomalies per kind, by bucket of the inbound record's publish time.

    `span`: the earliest and latest publish time audited (from the summaries' job); both series
    come back in one Spark job.
    """
    lo, hi = span
    width = bucket_width(hi - lo if lo is not None and hi is not None else 0)
    bucket = (F.floor(F.col("publish_ms") / F.lit(width)) * F.lit(width)).cast("long").alias("bucket_ms")
    null_str, null_long, null_double = (F.lit(None).cast(t) for t in ("string", "long", "double"))
    lateness = (
        audited.where(F.col("status") == "delivered")
        .groupBy("topic", "subscription", bucket)
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.percentile("lateness_ms", F.lit(0.5)).alias("p50_ms"),
            F.percentile("lateness_ms", F.lit(0.99)).alias("p99_ms"),
            F.max("lateness_ms").alias("max_ms"),
        )
        .select("topic", "subscription", "bucket_ms", "n", "p50_ms", "p99_ms", "max_ms", null_str.alias("kind"))
    )
    kinds = (
        anomalies.where(F.col("publish_ms").isNotNull())
        .groupBy("kind", bucket)
        .agg(F.count(F.lit(1)).alias("n"))
        .select(
            null_str.alias("topic"),
            null_str.alias("subscription"),
            "bucket_ms",
            "n",
            null_double.alias("p50_ms"),
            null_double.alias("p99_ms"),
            null_long.alias("max_ms"),
            "kind",
        )
    )
    rows = lateness.unionAll(kinds).collect()
    return Timeline(
        width,
        sorted(
            (
                {
                    "topic": r["topic"],
                    "subscription": r["subscription"],
                    "bucket_ms": int(r["bucket_ms"]),
                    "delivered": int(r["n"]),
                    "p50_ms": float(r["p50_ms"]),
                    "p99_ms": float(r["p99_ms"]),
                    "max_ms": int(r["max_ms"]),
                }
                for r in rows
                if r["kind"] is None
            ),
            key=lambda r: (r["topic"], r["subscription"], r["bucket_ms"]),
        ),
        sorted(
            ({"kind": r["kind"], "bucket_ms": int(r["bucket_ms"]), "count": int(r["n"])} for r in rows if r["kind"]),
            key=lambda r: (r["kind"], r["bucket_ms"]),
        ),
    )
