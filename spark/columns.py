"""Column expressions over a Kafka record's headers, and the audit's own reading of the delay headers.

Both the read phase and the tests of the delay contract need them. They are plain generated-code
expressions (no Python UDF, no lambda), which is what keeps the read cheap at a billion records;
the delay headers are parsed here independently of the sidecar's parser, so that the audit checks
the sidecar's reading rather than repeats it.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F  # noqa: N812

MAX_EPOCH_MS = 253_402_300_799_999  # year 9999, as sidecar.durations
RFC3339 = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?([Zz]|[+-][0-9]{2}:[0-9]{2})$"
DURATION = r"^([0-9]{1,18})(ms|s|m|h|d)?$"


def header_position(name: str) -> Column:
    """1-based position of the first header called `name` (0: none; null: no headers).

    array_position over the extracted keys is generated code; a higher-order filter with a lambda
    is interpreted row by row and cost several times more on millions of records.
    """
    return F.array_position(F.col("headers.key"), F.lit(name))


def header_count(name: str) -> Column:
    keys = F.col("headers.key")
    return F.coalesce(F.size(keys) - F.size(F.array_remove(keys, F.lit(name))), F.lit(0))


def header_text(name: str) -> Column:
    """The first value of header `name` as a string, null when absent."""
    return F.get(F.col("headers.value"), header_position(name) - 1).cast("string")


def header_long(name: str) -> Column:
    return F.trim(header_text(name)).try_cast("long")


def with_requested_deliver_at(frame: DataFrame, publish_ms: str = "publish_ms") -> DataFrame:
    """`frame` (Kafka schema with headers) plus `requested_ms`: the deliver-at its delay headers ask for.

    Independent of the sidecar's code (contract section 1): epoch ms or RFC 3339 for `deliver-at`,
    ms or 250ms/30s/5m/2h/7d for `deliver-after`. Null when there is no delay header, or when the
    headers are invalid (two delay headers, negative or unparseable values, after year 9999).
    The header values are extracted once into columns, then parsed.
    """
    staged = frame.withColumns(
        {
            "_n": header_count("deliver-at") + header_count("deliver-after"),
            "_at": header_text("deliver-at"),
            "_after": header_text("deliver-after"),
        }
    )
    at_text, after_text = F.col("_at"), F.col("_after")
    at_ms = F.when(at_text.rlike(r"^[0-9]{1,18}$"), at_text.try_cast("long")).when(
        at_text.rlike(RFC3339), F.unix_millis(F.upper(at_text).try_cast("timestamp"))
    )
    number = F.regexp_extract(after_text, DURATION, 1)
    unit = F.regexp_extract(after_text, DURATION, 2)
    unit_ms = (
        F.when(unit == "s", F.lit(1_000))
        .when(unit == "m", F.lit(60_000))
        .when(unit == "h", F.lit(3_600_000))
        .when(unit == "d", F.lit(86_400_000))
        .otherwise(F.lit(1))
        .cast("long")
    )
    after_ms = F.when(number != "", F.try_add(F.col(publish_ms), F.try_multiply(number.try_cast("long"), unit_ms)))
    requested = F.when(F.col("_n") != 1, F.lit(None).cast("long")).when(at_text.isNotNull(), at_ms).otherwise(after_ms)
    return staged.withColumn("requested_ms", F.when(requested <= F.lit(MAX_EPOCH_MS), requested)).drop(
        "_n", "_at", "_after"
    )


def expected_due(at_once: Column) -> Column:
    """The deliver-at the policy gives a record (columns publish_ms, requested_ms, delays_enabled,
    fixed_delay_ms): its publish time when `at_once` (exclusive and failover subscriptions) or
    delays are disabled, publish + the fixed delay when there is one, else the requested time,
    never before the publish time. Worked out here, apart from the sidecar's code."""
    publish = F.col("publish_ms")
    return (
        F.when(at_once | ~F.col("delays_enabled"), publish)
        .when(F.col("fixed_delay_ms") > 0, publish + F.col("fixed_delay_ms"))
        .otherwise(F.greatest(F.coalesce(F.col("requested_ms"), publish), publish))
    )
