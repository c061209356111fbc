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
  its deliver-at + grace; otherwise `nack_missing` (or pending).
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
from spark.kafka_source import HEADERS_TYPE

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

    def as_json(self) -> dict[str, Any]:
        return {
            "subscriptions": [asdict(s) for s in self.subscriptions],
            "rejections": self.rejections,
            "control_rejections": self.control_rejections,
            "anomaly_counts": self.anomaly_counts,
            "orphans": self.orphans,
        }


def routes_frame(spark: SparkSession, routes: Sequence[AuditRoute]) -> DataFrame:
    rows = [
        (r.topic, r.subscription, r.outbound, r.dead_letter_topic, r.ordered, r.delays_enabled, int(r.fixed_delay_ms))
        for r in routes
    ]
    return spark.createDataFrame(rows, ROUTE_SCHEMA)


def _headers() -> Column:
    return F.coalesce(F.col("headers"), F.array().cast(HEADERS_TYPE))


def header_values(name: str) -> Column:
    return F.filter(_headers(), lambda h: h["key"] == F.lit(name))


def header_text(name: str) -> Column:
    """The first value of header `name` as a string, null when absent."""
    return F.get(header_values(name), 0)["value"].cast("string")


def header_long(name: str) -> Column:
    return F.trim(header_text(name)).try_cast("long")


def with_requested_deliver_at(frame: DataFrame, publish_ms: str = "publish_ms") -> DataFrame:
    """`frame` (Kafka schema with headers) plus `requested_ms`: the deliver-at its delay headers ask for.

    Independent of the sidecar's code (contract section 1): epoch ms or RFC 3339 for `deliver-at`,
    ms or 250ms/30s/5m/2h/7d for `deliver-after`. Null when there is no delay header, or when the
    headers are invalid (two delay headers, negative or unparseable values, after year 9999).
    The header values are extracted once into columns, then parsed.
    """
    at = header_values("deliver-at")
    after = header_values("deliver-after")
    staged = frame.withColumns(
        {
            "_n": F.size(at) + F.size(after),
            "_at": F.get(at, 0)["value"].cast("string"),
            "_after": F.get(after, 0)["value"].cast("string"),
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


def _prepare_inbound(inputs: AuditInputs, params: AuditParams, routes: DataFrame) -> DataFrame:
    topics = routes.select("topic").distinct()
    inbound = inputs.inbound.join(F.broadcast(topics), "topic", "left_semi")
    inb = with_requested_deliver_at(
        inbound.select("topic", "partition", "offset", F.unix_millis(F.col("timestamp")).alias("publish_ms"), "headers")
    ).drop("headers")
    if params.from_ms is not None:
        inb = inb.where(F.col("publish_ms") >= F.lit(params.from_ms))
    if params.to_ms is not None:
        inb = inb.where(F.col("publish_ms") < F.lit(params.to_ms))
    return inb


def _origin(frame: DataFrame) -> list[Column]:
    return [
        header_text(ORIGIN_TOPIC).alias("topic"),
        header_long(ORIGIN_PARTITION).cast("int").alias("partition"),
        header_long(ORIGIN_OFFSET).alias("offset"),
    ]


def _prepare_dead_letter(inputs: AuditInputs, routes: DataFrame) -> DataFrame:
    pairs = routes.select("topic", F.col("dead_letter_topic").alias("dlt_topic")).distinct()
    dlt = inputs.dead_letter.select(
        *_origin(inputs.dead_letter),
        header_text(ERROR_CODE).alias("code"),
        header_text(ERROR_MESSAGE).alias("message"),
        F.col("topic").alias("dlt_topic"),
        F.col("partition").alias("dlt_partition"),
        F.col("offset").alias("dlt_offset"),
    )
    return dlt.join(F.broadcast(pairs), ["topic", "dlt_topic"], "left_semi")


def _prepare_outbound(inputs: AuditInputs, routes: DataFrame) -> DataFrame:
    pairs = routes.select(F.col("outbound").alias("outbound_topic"), "topic", "subscription").distinct()
    out = inputs.outbound.select(
        *_origin(inputs.outbound),
        F.col("topic").alias("outbound_topic"),
        F.col("partition").alias("outbound_partition"),
        F.col("offset").alias("outbound_offset"),
        F.unix_millis(F.col("timestamp")).alias("delivered_ms"),
        header_long(DELIVER_AT).alias("deliver_at_ms"),
        F.coalesce(header_long(REDELIVERY_COUNT).cast("int"), F.lit(0)).alias("redelivery_count"),
    )
    # Left: a record on an outbound topic whose origin header names no routed topic is still counted (orphan).
    return out.join(F.broadcast(pairs), ["outbound_topic", "topic"], "left")


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


def run_audit(
    spark: SparkSession, inputs: AuditInputs, routes: Sequence[AuditRoute], params: AuditParams
) -> AuditResult:
    """Join inbound, outbound, dead-letter and control records on their origin and judge each record."""
    routes_df = F.broadcast(routes_frame(spark, routes))
    grace = F.lit(params.grace_ms)
    as_of = F.lit(params.as_of_ms)

    inb = _prepare_inbound(inputs, params, routes_df).persist()
    keys = inb.select(*KEYS)
    dlt = _prepare_dead_letter(inputs, routes_df).join(keys, KEYS, "left_semi").persist()
    out_all = _prepare_outbound(inputs, routes_df).persist()
    out = out_all.where(F.col("subscription").isNotNull()).join(keys, KEYS, "left_semi")
    copy_order = Window.partitionBy("topic", "partition", "offset", "subscription", "redelivery_count").orderBy(
        "outbound_partition", "outbound_offset"
    )
    out = out.withColumn("copy", F.row_number().over(copy_order)).persist()

    # Every audited inbound record, once per subscription of its topic, with its fate.
    rejected = dlt.groupBy(*KEYS).agg(F.min_by("code", "dlt_offset").alias("code"))
    first = out.where((F.col("redelivery_count") == 0) & (F.col("copy") == 1)).select(
        *KEYS,
        "subscription",
        "delivered_ms",
        "deliver_at_ms",
        "outbound_topic",
        "outbound_partition",
        "outbound_offset",
    )
    expected_due = (
        F.when(F.col("ordered") | ~F.col("delays_enabled"), F.col("publish_ms"))
        .when(F.col("fixed_delay_ms") > 0, F.col("publish_ms") + F.col("fixed_delay_ms"))
        .otherwise(F.greatest(F.coalesce(F.col("requested_ms"), F.col("publish_ms")), F.col("publish_ms")))
    )
    fates = (
        inb.join(routes_df.select("topic", "subscription", "ordered", "delays_enabled", "fixed_delay_ms"), "topic")
        .withColumn("due_ms", expected_due)
        .join(rejected, KEYS, "left")
        .join(first, [*KEYS, "subscription"], "left")
        .withColumn("is_rejected", F.col("code").isNotNull())
        .withColumn("is_delivered", F.col("delivered_ms").isNotNull())
        .withColumn(
            "lateness_ms",
            F.col("delivered_ms")
            - F.greatest(F.coalesce(F.col("deliver_at_ms"), F.col("due_ms")), F.col("publish_ms")),
        )
        .withColumn(
            "status",
            F.when(F.col("is_rejected") & F.col("is_delivered"), "rejected_and_delivered")
            .when(F.col("is_rejected"), "rejected")
            .when(F.col("is_delivered"), "delivered")
            .when(F.col("due_ms") + grace > as_of, "pending")
            .otherwise("missing"),
        )
        .persist()
    )

    redeliveries = out.where((F.col("redelivery_count") > 0) & (F.col("copy") == 1)).join(
        inb.select(*KEYS, "publish_ms"), KEYS
    )
    redeliveries = redeliveries.withColumn(
        "lateness_ms", F.col("delivered_ms") - F.greatest(F.col("deliver_at_ms"), F.col("publish_ms"))
    ).persist()

    nack_fates = _nack_fates(inputs, routes_df, keys, redeliveries, params)

    anomaly_parts = [
        _anomaly(fates.where(F.col("status") == "missing"), "missing", deliver_at_ms=F.col("due_ms")),
        _anomaly(
            fates.where(F.col("status") == "rejected_and_delivered"),
            "rejected_and_delivered",
            redelivery_count=F.lit(0),
            detail=F.concat(F.lit("dead-lettered with "), F.col("code"), F.lit(" and delivered")),
        ),
        _anomaly(
            fates.where((F.col("status") == "delivered") & (F.col("lateness_ms") > grace)),
            "late",
            redelivery_count=F.lit(0),
            detail=F.concat(F.lit("later than the grace period of "), grace.cast("string"), F.lit(" ms")),
        ),
        _anomaly(
            out.where(F.col("copy") > 1),
            "duplicate",
            detail=F.concat(F.lit("copy "), F.col("copy").cast("string")),
        ),
        _anomaly(
            dlt.withColumn(
                "copy", F.row_number().over(Window.partitionBy(*KEYS).orderBy("dlt_partition", "dlt_offset"))
            ).where(F.col("copy") > 1),
            "duplicate",
            subscription=F.lit(DEAD_LETTER_SUBSCRIPTION),
            outbound_topic=F.col("dlt_topic"),
            outbound_partition=F.col("dlt_partition"),
            outbound_offset=F.col("dlt_offset"),
            detail=F.concat(F.lit("dead-lettered again with "), F.coalesce(F.col("code"), F.lit("no code"))),
        ),
        _anomaly(
            out.where(F.col("delivered_ms") < F.col("deliver_at_ms")),
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

    summaries = _summaries(fates, anomalies, redeliveries, nack_fates, routes)
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
        out_all.join(keys, KEYS, "left_anti")
        .groupBy("outbound_topic")
        .agg(F.count(F.lit(1)).alias("n"))
        .select(F.lit("orphan"), "outbound_topic", F.lit(None).cast("string"), "n"),
    ]
    if inputs.control_dead_letter is not None:
        info.append(
            inputs.control_dead_letter.select(header_text(ERROR_CODE).alias("code"))
            .groupBy("code")
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
    orphans = {n: k for sec, n, _, k in rows if sec == "orphan"}
    rejected_records = dlt.select(*KEYS, "code", "message", "dlt_topic", "dlt_partition", "dlt_offset")
    return AuditResult(summaries, rejections, control_rejections, counts, anomalies, rejected_records, orphans)


def _parsed_control(inputs: AuditInputs) -> DataFrame | None:
    if inputs.control is None:
        return None
    commands = inputs.control.select(
        F.col("partition").alias("control_partition"),
        F.col("offset").alias("control_offset"),
        F.unix_millis(F.col("timestamp")).alias("command_ms"),
        F.from_json(F.col("value").cast("string"), NACK_SCHEMA).alias("c"),
    )
    if inputs.control_dead_letter is not None:
        refused = inputs.control_dead_letter.select(
            header_text(ORIGIN_TOPIC).alias("origin_topic"),
            header_long(ORIGIN_PARTITION).cast("int").alias("control_partition"),
            header_long(ORIGIN_OFFSET).alias("control_offset"),
        ).where(F.col("origin_topic") == F.lit(inputs.control_topic))
        commands = commands.join(refused, ["control_partition", "control_offset"], "left_anti")
    return commands.where(F.col("c.type") == "nack").select(
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


def _nack_fates(
    inputs: AuditInputs, routes: DataFrame, keys: DataFrame, redeliveries: DataFrame, params: AuditParams
) -> DataFrame | None:
    """Each (record, subscription) with valid nack commands: its latest command and whether it was honoured."""
    commands = _parsed_control(inputs)
    if commands is None:
        return None
    commands = commands.join(routes.select("topic", "subscription"), ["topic", "subscription"], "left_semi").join(
        keys, KEYS, "left_semi"
    )
    latest = commands.groupBy(*KEYS, "subscription").agg(
        F.count("*").alias("commands"),
        F.max_by(
            F.struct("due_ms", "command_ms", "control_partition", "control_offset"),
            F.struct("command_ms", "control_offset"),
        ).alias("last"),
    )
    latest = latest.select(*KEYS, "subscription", "commands", "last.*")
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
) -> list[SubscriptionSummary]:
    status = F.col("status")
    main = fates.groupBy("topic", "subscription").agg(
        F.count("*").alias("inbound"),
        F.count_if(F.col("is_rejected")).alias("rejected"),
        F.count_if(~F.col("is_rejected")).alias("accepted"),
        F.count_if(status == "delivered").alias("delivered"),
        F.count_if(status == "pending").alias("pending"),
        F.count_if(status == "missing").alias("missing"),
        F.count_if(status == "rejected_and_delivered").alias("rejected_and_delivered"),
        *_percentiles("lateness_ms", "lateness"),
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
    for row in joined.collect():
        key = (row["topic"], row["subscription"])
        summary = summaries.setdefault(key, SubscriptionSummary(*key))
        for name, value in row.asDict().items():
            if name in ("topic", "subscription") or value is None:
                continue
            setattr(summary, name, int(value) if fields[name] in ("int", "int | None") else float(value))
    return [summaries[k] for k in sorted(summaries)]
