"""The audit of every inbound record's fate, as Spark DataFrame logic (no I/O, no knowledge of the source).

Inputs are DataFrames with the schema of Spark's Kafka source (with headers): the inbound topics,
the outbound topics of their subscriptions, their dead-letter topics, and optionally the control
topic and its dead-letter topic. The routes say which outbound and dead-letter topic belongs to
which inbound topic and subscription. The logic is pure DataFrame expressions (no Python UDFs), so
it runs wherever Spark runs, on either Kafka source.

Rules (contract sections 1-5):

* accepted: an inbound record that is not on its dead-letter topic. It must appear on EVERY
  subscription's outbound topic with `delay-redelivery-count` 0.
* delivered: it did. pending: it did not, and its expected deliver-at + grace is later than the
  audit's as-of time (still legitimately waiting). missing: neither.
  The expected deliver-at is computed here, independently of the sidecar, from the inbound delay
  headers and the topic's policy (enabled, fixed delay; exclusive/failover subscriptions: at once).
* duplicate: the same origin, subscription and redelivery count delivered more than once; one
  anomaly per extra copy. A record dead-lettered twice is a duplicate on subscription "(dead-letter)";
  a record both dead-lettered and delivered is `rejected_and_delivered`.
* early: an outbound record whose Kafka timestamp (delivery time) is before its `delay-deliver-at`.
* lateness: delivery time - max(delay-deliver-at, publish time), for first deliveries (a deliver-at
  in the past means "at once", measured from publish); `late` anomalies exceed the grace period.
* nack redeliveries: outbound records with `delay-redelivery-count` > 0, their lateness; each valid
  nack command (control topic, not on the control dead-letter topic) for an audited record must be
  followed by a redelivery to that subscription, at or after the latest command's timestamp, by
  its deliver-at + grace; otherwise `nack_missing` (or pending). Only `"type":"nack"` records of
  the control topic are commands: the sidecar's own `"type":"accepted"` records there are not.

How it runs (the shape matters at a billion records): every input is first reduced to a few
columns (prepare: the headers parsed once, the payloads dropped) and cached; that is the read.
Then ONE shuffle brings each record's inbound row, its first deliveries and its dead-letter rows
together per (record, subscription), and a hash aggregation judges them. Everything else
(redeliveries, duplicates, early deliveries, nack commands) is small and joins by broadcast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F  # noqa: N812
from pyspark.sql.types import (
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from sidecar.outbound.records import (
    DELIVER_AT,
    ERROR_CODE,
    ERROR_MESSAGE,
    ORIGIN_OFFSET,
    ORIGIN_PARTITION,
    ORIGIN_TOPIC,
    REDELIVERY_COUNT,
)

DEAD_LETTER_SUBSCRIPTION = "(dead-letter)"
MAX_EPOCH_MS = 253_402_300_799_999  # year 9999, as sidecar.durations

KINDS = ("missing", "nack_missing", "duplicate", "rejected_and_delivered", "early", "late")
"""Every anomaly kind; `late` is reported but has no threshold by default."""

ANOMALY_SCHEMA = StructType(
    [
        StructField("kind", StringType(), False),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("subscription", StringType()),
        StructField("redelivery_count", IntegerType()),
        StructField("publish_ms", LongType()),
        StructField("deliver_at_ms", LongType()),
        StructField("delivered_ms", LongType()),
        StructField("lateness_ms", LongType()),
        StructField("outbound_topic", StringType()),
        StructField("outbound_partition", IntegerType()),
        StructField("outbound_offset", LongType()),
        StructField("detail", StringType()),
    ]
)

ROUTE_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("subscription", StringType(), False),
        StructField("outbound", StringType(), False),
        StructField("dead_letter_topic", StringType(), False),
        StructField("ordered", BooleanType(), False),
        StructField("delays_enabled", BooleanType(), False),
        StructField("fixed_delay_ms", LongType(), False),
    ]
)

NACK_SCHEMA = StructType(
    [
        StructField("v", LongType()),
        StructField("type", StringType()),
        StructField("subscription", StringType()),
        StructField("topic", StringType()),
        StructField("partition", LongType()),
        StructField("offset", LongType()),
        StructField("delay_ms", LongType()),
        StructField("deliver_at", LongType()),
    ]
)

KEYS = ["topic", "partition", "offset"]
RFC3339 = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?([Zz]|[+-][0-9]{2}:[0-9]{2})$"
DURATION = r"^([0-9]{1,18})(ms|s|m|h|d)?$"


@dataclass(frozen=True)
class AuditRoute:
    """Where an inbound topic's records must go for one subscription, and the delay policy that applies."""

    topic: str
    subscription: str
    outbound: str
    dead_letter_topic: str
    ordered: bool = False
    delays_enabled: bool = True
    fixed_delay_ms: int = 0


@dataclass(frozen=True)
class AuditParams:
    as_of_ms: int
    """The audit's end time: records due (deliver-at + grace) after it are pending, not missing."""
    grace_ms: int = 30_000
    from_ms: int | None = None
    """Only inbound records published at or after this time (epoch ms) are audited."""
    to_ms: int | None = None
    """Only inbound records published before this time are audited."""


@dataclass
class AuditInputs:
    """DataFrames with the Kafka source schema (includeHeaders=true); control ones may be None."""

    inbound: DataFrame
    outbound: DataFrame
    dead_letter: DataFrame
    control: DataFrame | None = None
    control_dead_letter: DataFrame | None = None
    control_topic: str = "delay-sidecar.control"


@dataclass
class SubscriptionSummary:
    topic: str
    subscription: str
    inbound: int = 0
    rejected: int = 0
    accepted: int = 0
    delivered: int = 0
    pending: int = 0
    missing: int = 0
    duplicates: int = 0
    early: int = 0
    late: int = 0
    rejected_and_delivered: int = 0
    lateness_p50_ms: float | None = None
    lateness_p95_ms: float | None = None
    lateness_p99_ms: float | None = None
    lateness_max_ms: int | None = None
    redelivered: int = 0
    redelivery_lateness_p50_ms: float | None = None
    redelivery_lateness_p95_ms: float | None = None
    redelivery_lateness_p99_ms: float | None = None
    redelivery_lateness_max_ms: int | None = None
    nacks: int = 0
    nacks_pending: int = 0
    nacks_missing: int = 0


@dataclass
class AuditResult:
    subscriptions: list[SubscriptionSummary]
    rejections: list[dict[str, Any]]
    """Per inbound topic and code: {"topic", "code", "count"}."""
    control_rejections: list[dict[str, Any]]
    """Per code, control commands on the control dead-letter topic: {"code", "count"}."""
    anomaly_counts: dict[str, int]
    """Per kind in KINDS."""
    anomalies: DataFrame
    """Every anomaly, ANOMALY_SCHEMA: kind and origin (topic, partition, offset, subscription) first."""
    rejected_records: DataFrame
    """Every audited inbound record found on its dead-letter topic, with origin, code and message."""
    orphans: dict[str, int] = field(default_factory=dict)
    """Outbound records per outbound topic whose origin is not an audited inbound record (informational:
    normal when the audit covers part of the inbound topics' history)."""
    records_read: dict[str, int] = field(default_factory=dict)
    """Records read per input (inbound, outbound, dead_letter, control, control_dead_letter)."""
    timeline: Timeline | None = None
    """Lateness per subscription and anomalies per kind over time, for the chart."""

    def as_json(self) -> dict[str, Any]:
        return {
            "records_read": self.records_read,
            "subscriptions": [asdict(s) for s in self.subscriptions],
            "rejections": self.rejections,
            "control_rejections": self.control_rejections,
            "anomaly_counts": self.anomaly_counts,
            "orphans": self.orphans,
            "timeline": asdict(self.timeline) if self.timeline else None,
        }


@dataclass
class Timeline:
    """Buckets of inbound publish time: how late each subscription delivered, and what went wrong, when."""

    bucket_ms: int
    lateness: list[dict[str, Any]]
    """{"topic", "subscription", "bucket_ms", "delivered", "p50_ms", "p99_ms", "max_ms"} per non-empty bucket."""
    anomalies: list[dict[str, Any]]
    """{"kind", "bucket_ms", "count"} per non-empty bucket."""


@dataclass
class Prepared:
    """The inputs reduced to the columns the audit needs, one row per Kafka record; cached by persist()."""

    inbound: DataFrame
    """topic, partition, offset, publish_ms, requested_ms."""
    outbound: DataFrame
    """Origin (topic, partition, offset), subscription (null: origin topic not routed to this outbound
    topic), outbound_topic, outbound_partition, outbound_offset, delivered_ms, deliver_at_ms, redelivery_count."""
    dead_letter: DataFrame
    """Origin, code, message, dlt_topic, dlt_partition, dlt_offset."""
    commands: DataFrame | None = None
    """Valid nack commands: control_partition, control_offset, command_ms, origin, subscription, due_ms."""
    control_rejections: DataFrame | None = None
    """code, one row per record of the control dead-letter topic."""

    def frames(self) -> dict[str, DataFrame]:
        named = {"inbound": self.inbound, "outbound": self.outbound, "dead_letter": self.dead_letter}
        if self.commands is not None:
            named["control"] = self.commands
        if self.control_rejections is not None:
            named["control_dead_letter"] = self.control_rejections
        return named

    def persist(self) -> Prepared:
        for frame in self.frames().values():
            frame.persist()
        return self

    def unpersist(self) -> None:
        for frame in self.frames().values():
            frame.unpersist()

    def materialise(self) -> dict[str, int]:
        """Read every input into the cache in one Spark job; the rows kept per input.

        For the control topic that is the valid nack commands, not every record read.
        """
        tagged = [f.select(F.lit(name).alias("input")) for name, f in self.frames().items()]
        union = tagged[0]
        for part in tagged[1:]:
            union = union.unionAll(part)
        counts = dict.fromkeys(self.frames(), 0)
        counts.update({r["input"]: int(r["count"]) for r in union.groupBy("input").count().collect()})
        return counts


def routes_frame(spark: SparkSession, routes: Sequence[AuditRoute]) -> DataFrame:
    rows = [
        (r.topic, r.subscription, r.outbound, r.dead_letter_topic, r.ordered, r.delays_enabled, int(r.fixed_delay_ms))
        for r in routes
    ]
    return spark.createDataFrame(rows, ROUTE_SCHEMA)


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


def _origin() -> list[Column]:
    return [
        header_text(ORIGIN_TOPIC).alias("topic"),
        header_long(ORIGIN_PARTITION).cast("int").alias("partition"),
        header_long(ORIGIN_OFFSET).alias("offset"),
    ]


def prepare(spark: SparkSession, inputs: AuditInputs, routes: Sequence[AuditRoute], params: AuditParams) -> Prepared:
    """Each input reduced to the audit's columns (lazy: persist() and materialise() read them)."""
    routes_df = F.broadcast(routes_frame(spark, routes))
    topics = routes_df.select("topic").distinct()
    inbound = inputs.inbound.join(topics, "topic", "left_semi")
    inb = with_requested_deliver_at(
        inbound.select("topic", "partition", "offset", F.unix_millis(F.col("timestamp")).alias("publish_ms"), "headers")
    ).drop("headers")
    if params.from_ms is not None:
        inb = inb.where(F.col("publish_ms") >= F.lit(params.from_ms))
    if params.to_ms is not None:
        inb = inb.where(F.col("publish_ms") < F.lit(params.to_ms))

    pairs = routes_df.select(F.col("outbound").alias("outbound_topic"), "topic", "subscription").distinct()
    out = inputs.outbound.select(
        *_origin(),
        F.col("topic").alias("outbound_topic"),
        F.col("partition").alias("outbound_partition"),
        F.col("offset").alias("outbound_offset"),
        F.unix_millis(F.col("timestamp")).alias("delivered_ms"),
        header_long(DELIVER_AT).alias("deliver_at_ms"),
        F.coalesce(header_long(REDELIVERY_COUNT).cast("int"), F.lit(0)).alias("redelivery_count"),
    )
    # Left: a record on an outbound topic whose origin header names no routed topic is still counted (orphan).
    out = out.join(F.broadcast(pairs), ["outbound_topic", "topic"], "left")

    dlt_pairs = routes_df.select("topic", F.col("dead_letter_topic").alias("dlt_topic")).distinct()
    dlt = inputs.dead_letter.select(
        *_origin(),
        header_text(ERROR_CODE).alias("code"),
        header_text(ERROR_MESSAGE).alias("message"),
        F.col("topic").alias("dlt_topic"),
        F.col("partition").alias("dlt_partition"),
        F.col("offset").alias("dlt_offset"),
    ).join(F.broadcast(dlt_pairs), ["topic", "dlt_topic"], "left_semi")

    commands = _parsed_control(inputs)
    if commands is not None:
        commands = commands.join(routes_df.select("topic", "subscription"), ["topic", "subscription"], "left_semi")
    refused = None
    if inputs.control_dead_letter is not None:
        refused = inputs.control_dead_letter.select(header_text(ERROR_CODE).alias("code"))
    return Prepared(inb, out, dlt, commands, refused)


def _parsed_control(inputs: AuditInputs) -> DataFrame | None:
    if inputs.control is None:
        return None
    commands = inputs.control.select(
        F.col("partition").alias("control_partition"),
        F.col("offset").alias("control_offset"),
        F.unix_millis(F.col("timestamp")).alias("command_ms"),
        F.from_json(F.col("value").cast("string"), NACK_SCHEMA).alias("c"),
    ).where(F.col("c.type") == "nack")  # the sidecar's "accepted" records share the topic: not commands
    if inputs.control_dead_letter is not None:
        refused = (
            inputs.control_dead_letter.select(
                header_text(ORIGIN_TOPIC).alias("origin_topic"),
                header_long(ORIGIN_PARTITION).cast("int").alias("control_partition"),
                header_long(ORIGIN_OFFSET).alias("control_offset"),
            )
            .where(F.col("origin_topic") == F.lit(inputs.control_topic))
            .drop("origin_topic")
        )
        commands = commands.join(refused, ["control_partition", "control_offset"], "left_anti")
    return commands.select(
        "control_partition",
        "control_offset",
        "command_ms",
        F.col("c.topic").alias("topic"),
        F.col("c.partition").cast("int").alias("partition"),
        F.col("c.offset").alias("offset"),
        F.col("c.subscription").alias("subscription"),
        F.coalesce(F.col("c.deliver_at"), F.col("command_ms") + F.coalesce(F.col("c.delay_ms"), F.lit(0))).alias(
            "due_ms"
        ),
    )


def _anomaly(frame: DataFrame, kind: str, **columns: Column) -> DataFrame:
    """Project `frame` onto ANOMALY_SCHEMA; columns not given come from `frame` when it has them."""
    have = set(frame.columns)
    projected = []
    for f in ANOMALY_SCHEMA.fields:
        if f.name == "kind":
            value = F.lit(kind)
        elif f.name in columns:
            value = columns[f.name]
        elif f.name in have:
            value = F.col(f.name)
        else:
            value = F.lit(None)
        projected.append(value.cast(f.dataType).alias(f.name))
    return frame.select(*projected)


def _percentiles(column: str, prefix: str) -> list[Column]:
    p = F.percentile(F.col(column), F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99)))
    return [
        p[0].alias(f"{prefix}_p50_ms"),
        p[1].alias(f"{prefix}_p95_ms"),
        p[2].alias(f"{prefix}_p99_ms"),
        F.max(column).alias(f"{prefix}_max_ms"),
    ]


_FIRST_TYPE = StructType(
    [
        StructField("outbound_partition", IntegerType()),
        StructField("outbound_offset", LongType()),
        StructField("delivered_ms", LongType()),
        StructField("deliver_at_ms", LongType()),
        StructField("outbound_topic", StringType()),
    ]
)


FIRST_FIELDS = ["outbound_partition", "outbound_offset", "delivered_ms", "deliver_at_ms", "outbound_topic"]
"""A delivery's position first: the minimum of these structs is the first copy written."""


def _first_copy() -> Column:
    return F.struct(*FIRST_FIELDS)


def _fates(prepared: Prepared, routes: DataFrame, params: AuditParams) -> DataFrame:
    """One row per (record, subscription) with anything on it: the single large shuffle of the audit.

    The inbound row (expanded per subscription), every first-time delivery (redelivery count 0) and
    every dead-letter row are unioned and grouped, rather than joined, so the records cross the
    cluster once and no side is sorted. Rows without an inbound record are orphans.
    """
    expected_due = (
        F.when(F.col("ordered") | ~F.col("delays_enabled"), F.col("publish_ms"))
        .when(F.col("fixed_delay_ms") > 0, F.col("publish_ms") + F.col("fixed_delay_ms"))
        .otherwise(F.greatest(F.coalesce(F.col("requested_ms"), F.col("publish_ms")), F.col("publish_ms")))
    )
    null_long, null_str = F.lit(None).cast("long"), F.lit(None).cast("string")
    route_cols = routes.select("topic", "subscription", "ordered", "delays_enabled", "fixed_delay_ms")
    inbound_rows = prepared.inbound.join(route_cols, "topic").select(
        *KEYS,
        "subscription",
        F.lit(0).alias("src"),
        "publish_ms",
        expected_due.alias("due_ms"),
        F.lit(None).cast(_FIRST_TYPE).alias("copy"),
        null_str.alias("code"),
        null_long.alias("dlt_offset"),
    )
    outbound_rows = prepared.outbound.where(
        F.col("subscription").isNotNull() & (F.col("redelivery_count") == 0)
    ).select(
        *KEYS,
        "subscription",
        F.lit(1).alias("src"),
        null_long.alias("publish_ms"),
        null_long.alias("due_ms"),
        _first_copy().alias("copy"),
        null_str.alias("code"),
        null_long.alias("dlt_offset"),
    )
    dead_rows = prepared.dead_letter.join(route_cols.select("topic", "subscription"), "topic").select(
        *KEYS,
        "subscription",
        F.lit(2).alias("src"),
        null_long.alias("publish_ms"),
        null_long.alias("due_ms"),
        F.lit(None).cast(_FIRST_TYPE).alias("copy"),
        "code",
        "dlt_offset",
    )
    src = F.col("src")
    grouped = (
        inbound_rows.unionAll(outbound_rows)
        .unionAll(dead_rows)
        .groupBy(*KEYS, "subscription")
        .agg(
            (F.count_if(src == 0) > 0).alias("has_inbound"),
            F.max("publish_ms").alias("publish_ms"),
            F.max("due_ms").alias("due_ms"),
            F.count_if(src == 1).alias("copies"),
            F.min("copy").alias("first"),
            F.min_by("code", "dlt_offset").alias("code"),
        )
    )
    grace = F.lit(params.grace_ms)
    return (
        grouped.select(*KEYS, "subscription", "has_inbound", "publish_ms", "due_ms", "copies", "code", "first.*")
        .withColumn("is_rejected", F.col("code").isNotNull())
        .withColumn("is_delivered", F.col("copies") > 0)
        .withColumn(
            "lateness_ms",
            F.col("delivered_ms")
            - F.greatest(F.coalesce(F.col("deliver_at_ms"), F.col("due_ms")), F.col("publish_ms")),
        )
        .withColumn(
            "status",
            F.when(~F.col("has_inbound"), "orphan")
            .when(F.col("is_rejected") & F.col("is_delivered"), "rejected_and_delivered")
            .when(F.col("is_rejected"), "rejected")
            .when(F.col("is_delivered"), "delivered")
            .when(F.col("due_ms") + grace > F.lit(params.as_of_ms), "pending")
            .otherwise("missing"),
        )
    )


def run_audit(
    spark: SparkSession, inputs: AuditInputs, routes: Sequence[AuditRoute], params: AuditParams
) -> AuditResult:
    """Prepare, read and judge in one call (the job splits these steps to time them)."""
    prepared = prepare(spark, inputs, routes, params).persist()
    records_read = prepared.materialise()
    result = analyse(spark, prepared, routes, params)
    result.records_read = records_read
    return result


def analyse(spark: SparkSession, prepared: Prepared, routes: Sequence[AuditRoute], params: AuditParams) -> AuditResult:
    """Judge every audited record from the prepared (ideally cached) inputs."""
    routes_df = F.broadcast(routes_frame(spark, routes))
    grace = F.lit(params.grace_ms)
    inb = prepared.inbound
    published = inb.select(*KEYS, "publish_ms")
    out = prepared.outbound

    fates = _fates(prepared, routes_df, params).persist()
    audited = fates.where(F.col("has_inbound"))

    # Small sides, joined to the audited records by broadcast (the inbound side is never shuffled again).
    dlt = prepared.dead_letter.hint("broadcast").join(published, KEYS)
    redelivery_groups = (
        out.where(F.col("subscription").isNotNull() & (F.col("redelivery_count") > 0))
        .groupBy(*KEYS, "subscription", "redelivery_count")
        .agg(F.count(F.lit(1)).alias("copies"), F.min(_first_copy()).alias("first"))
        .select(*KEYS, "subscription", "redelivery_count", "copies", "first.*")
    )
    redeliveries = (
        redelivery_groups.hint("broadcast")
        .join(published, KEYS)
        .withColumn("lateness_ms", F.col("delivered_ms") - F.greatest(F.col("deliver_at_ms"), F.col("publish_ms")))
        .persist()
    )
    duplicated = audited.where(F.col("copies") > 1).select(
        *KEYS, "subscription", F.lit(0).alias("redelivery_count"), "publish_ms", "outbound_partition", "outbound_offset"
    )
    duplicated = duplicated.unionByName(
        redeliveries.where(F.col("copies") > 1).select(
            *KEYS, "subscription", "redelivery_count", "publish_ms", "outbound_partition", "outbound_offset"
        )
    ).withColumnsRenamed({"outbound_partition": "first_partition", "outbound_offset": "first_offset"})
    extra_copies = (
        out.join(F.broadcast(duplicated), [*KEYS, "subscription", "redelivery_count"])
        .where(
            (F.col("outbound_partition") != F.col("first_partition"))
            | (F.col("outbound_offset") != F.col("first_offset"))
        )
        .withColumn(
            "copy",
            F.row_number().over(
                Window.partitionBy(*KEYS, "subscription", "redelivery_count").orderBy(
                    "outbound_partition", "outbound_offset"
                )
            )
            + 1,
        )
    )
    early = (
        out.where(F.col("subscription").isNotNull() & (F.col("delivered_ms") < F.col("deliver_at_ms")))
        .hint("broadcast")
        .join(published, KEYS)
    )
    nack_fates = _nack_fates(prepared.commands, published, redeliveries, params)

    dlt_copy = Window.partitionBy(*KEYS).orderBy("dlt_partition", "dlt_offset")
    anomaly_parts = [
        _anomaly(audited.where(F.col("status") == "missing"), "missing", deliver_at_ms=F.col("due_ms")),
        _anomaly(
            audited.where(F.col("status") == "rejected_and_delivered"),
            "rejected_and_delivered",
            redelivery_count=F.lit(0),
            detail=F.concat(F.lit("dead-lettered with "), F.col("code"), F.lit(" and delivered")),
        ),
        _anomaly(
            audited.where((F.col("status") == "delivered") & (F.col("lateness_ms") > grace)),
            "late",
            redelivery_count=F.lit(0),
            detail=F.concat(F.lit("later than the grace period of "), grace.cast("string"), F.lit(" ms")),
        ),
        _anomaly(extra_copies, "duplicate", detail=F.concat(F.lit("copy "), F.col("copy").cast("string"))),
        _anomaly(
            dlt.withColumn("copy", F.row_number().over(dlt_copy)).where(F.col("copy") > 1),
            "duplicate",
            subscription=F.lit(DEAD_LETTER_SUBSCRIPTION),
            outbound_topic=F.col("dlt_topic"),
            outbound_partition=F.col("dlt_partition"),
            outbound_offset=F.col("dlt_offset"),
            detail=F.concat(F.lit("dead-lettered again with "), F.coalesce(F.col("code"), F.lit("no code"))),
        ),
        _anomaly(
            early,
            "early",
            lateness_ms=F.col("delivered_ms") - F.col("deliver_at_ms"),
            detail=F.concat(
                F.lit("delivered "), (F.col("deliver_at_ms") - F.col("delivered_ms")).cast("string"), F.lit(" ms early")
            ),
        ),
    ]
    if nack_fates is not None:
        anomaly_parts.append(
            _anomaly(
                nack_fates.where(F.col("status") == "missing"),
                "nack_missing",
                deliver_at_ms=F.col("due_ms"),
                detail=F.concat(
                    F.lit("nack at control offset "),
                    F.col("control_partition").cast("string"),
                    F.lit("/"),
                    F.col("control_offset").cast("string"),
                    F.lit(" got no redelivery"),
                ),
            )
        )
    anomalies = anomaly_parts[0]
    for part in anomaly_parts[1:]:
        anomalies = anomalies.unionByName(part)
    anomalies = anomalies.persist()

    summaries, span = _summaries(fates, anomalies, redeliveries, nack_fates, routes)
    counts = {
        "missing": sum(s.missing for s in summaries),
        "nack_missing": sum(s.nacks_missing for s in summaries),
        "duplicate": sum(s.duplicates for s in summaries),
        "rejected_and_delivered": sum(s.rejected_and_delivered for s in summaries),
        "early": sum(s.early for s in summaries),
        "late": sum(s.late for s in summaries),
    }
    # The small tables of the report in one Spark job: (section, name, code, count).
    info = [
        dlt.groupBy("topic", "code").agg(F.count(F.lit(1)).alias("n")).select(F.lit("rejection"), "topic", "code", "n"),
        out.where(F.col("subscription").isNull())
        .groupBy("outbound_topic")
        .agg(F.count(F.lit(1)).alias("n"))
        .select(F.lit("orphan"), "outbound_topic", F.lit(None).cast("string"), "n"),
        fates.where(~F.col("has_inbound"))
        .groupBy("outbound_topic")
        .agg(F.sum("copies").alias("n"))
        .select(F.lit("orphan"), "outbound_topic", F.lit(None).cast("string"), "n"),
        redelivery_groups.hint("broadcast")
        .join(published, KEYS, "left_anti")
        .groupBy("outbound_topic")
        .agg(F.sum("copies").alias("n"))
        .select(F.lit("orphan"), "outbound_topic", F.lit(None).cast("string"), "n"),
    ]
    if prepared.control_rejections is not None:
        info.append(
            prepared.control_rejections.groupBy("code")
            .agg(F.count(F.lit(1)).alias("n"))
            .select(F.lit("control_rejection"), F.lit(None).cast("string"), "code", "n")
        )
    info_df = info[0]
    for part in info[1:]:
        info_df = info_df.union(part)
    rows = sorted(
        ((r[0], r[1] or "", r[2] or "", int(r[3])) for r in info_df.toDF("section", "name", "code", "n").collect()),
    )
    rejections = [{"topic": n, "code": c, "count": k} for sec, n, c, k in rows if sec == "rejection"]
    control_rejections = [{"code": c, "count": k} for sec, _, c, k in rows if sec == "control_rejection"]
    orphans: dict[str, int] = {}
    for sec, name, _, k in rows:
        if sec == "orphan":
            orphans[name] = orphans.get(name, 0) + k
    rejected_records = dlt.select(*KEYS, "code", "message", "dlt_topic", "dlt_partition", "dlt_offset")
    timeline = _timeline(audited, anomalies, span)
    return AuditResult(
        summaries, rejections, control_rejections, counts, anomalies, rejected_records, orphans, timeline=timeline
    )


BUCKETS_MS = [1_000, 10_000, 60_000, 300_000, 900_000, 3_600_000, 21_600_000, 86_400_000, 7 * 86_400_000]


def bucket_width(span_ms: int, buckets: int = 60) -> int:
    """The smallest round width that shows `span_ms` in at most about `buckets` bars."""
    for width in BUCKETS_MS:
        if span_ms <= width * buckets:
            return width
    return BUCKETS_MS[-1]


def _timeline(audited: DataFrame, anomalies: DataFrame, span: tuple[int | None, int | None]) -> Timeline:
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


def _nack_fates(
    commands: DataFrame | None, published: DataFrame, redeliveries: DataFrame, params: AuditParams
) -> DataFrame | None:
    """Each (record, subscription) with valid nack commands: its latest command and whether it was honoured."""
    if commands is None:
        return None
    audited = commands.hint("broadcast").join(published, KEYS)
    latest = audited.groupBy(*KEYS, "subscription", "publish_ms").agg(
        F.count("*").alias("commands"),
        F.max_by(
            F.struct("due_ms", "command_ms", "control_partition", "control_offset"),
            F.struct("command_ms", "control_offset"),
        ).alias("last"),
    )
    latest = latest.select(*KEYS, "subscription", "publish_ms", "commands", "last.*")
    honoured = (
        latest.alias("l")
        .join(
            redeliveries.select(*KEYS, "subscription", F.col("delivered_ms").alias("redelivered_ms")).alias("r"),
            [*KEYS, "subscription"],
        )
        .where(F.col("redelivered_ms") >= F.col("command_ms"))
        .select(*KEYS, "subscription")
        .distinct()
        .withColumn("honoured", F.lit(True))
    )
    return (
        latest.join(honoured, [*KEYS, "subscription"], "left")
        .withColumn(
            "status",
            F.when(F.col("honoured"), "redelivered")
            .when(F.col("due_ms") + F.lit(params.grace_ms) > F.lit(params.as_of_ms), "pending")
            .otherwise("missing"),
        )
        .persist()
    )


def _summaries(
    fates: DataFrame,
    anomalies: DataFrame,
    redeliveries: DataFrame,
    nack_fates: DataFrame | None,
    routes: Sequence[AuditRoute],
) -> tuple[list[SubscriptionSummary], tuple[int | None, int | None]]:
    """The summary per (topic, subscription), and the earliest and latest publish time audited."""
    status = F.col("status")
    main = (
        fates.where(F.col("has_inbound"))
        .groupBy("topic", "subscription")
        .agg(
            F.count("*").alias("inbound"),
            F.count_if(F.col("is_rejected")).alias("rejected"),
            F.count_if(~F.col("is_rejected")).alias("accepted"),
            F.count_if(status == "delivered").alias("delivered"),
            F.count_if(status == "pending").alias("pending"),
            F.count_if(status == "missing").alias("missing"),
            F.count_if(status == "rejected_and_delivered").alias("rejected_and_delivered"),
            *_percentiles("lateness_ms", "lateness"),
            F.min("publish_ms").alias("_first_publish_ms"),
            F.max("publish_ms").alias("_last_publish_ms"),
        )
    )
    by_kind = (
        anomalies.where(F.col("kind").isin("duplicate", "early", "late"))
        .groupBy("topic", "subscription")
        .pivot("kind", ["duplicate", "early", "late"])
        .agg(F.count(F.lit(1)))
        .withColumnsRenamed({"duplicate": "duplicates"})
    )
    redelivered = redeliveries.groupBy("topic", "subscription").agg(
        F.count(F.lit(1)).alias("redelivered"), *_percentiles("lateness_ms", "redelivery_lateness")
    )
    # One Spark job: every per-subscription number joined on (topic, subscription).
    joined = main.join(by_kind, ["topic", "subscription"], "full").join(redelivered, ["topic", "subscription"], "full")
    if nack_fates is not None:
        nacks = nack_fates.groupBy("topic", "subscription").agg(
            F.sum("commands").alias("nacks"),
            F.count_if(F.col("status") == "pending").alias("nacks_pending"),
            F.count_if(F.col("status") == "missing").alias("nacks_missing"),
        )
        joined = joined.join(nacks, ["topic", "subscription"], "full")
    summaries: dict[tuple[str, str], SubscriptionSummary] = {
        (r.topic, r.subscription): SubscriptionSummary(r.topic, r.subscription) for r in routes
    }
    fields = {f.name: f.type for f in dataclasses.fields(SubscriptionSummary)}
    firsts: list[int] = []
    lasts: list[int] = []
    for row in joined.collect():
        key = (row["topic"], row["subscription"])
        summary = summaries.setdefault(key, SubscriptionSummary(*key))
        for name, value in row.asDict().items():
            if name == "_first_publish_ms" and value is not None:
                firsts.append(int(value))
            elif name == "_last_publish_ms" and value is not None:
                lasts.append(int(value))
            elif name not in ("topic", "subscription", "_first_publish_ms", "_last_publish_ms") and value is not None:
                setattr(summary, name, int(value) if fields[name] in ("int", "int | None") else float(value))
    span = (min(firsts) if firsts else None, max(lasts) if lasts else None)
    return [summaries[k] for k in sorted(summaries)], span
