"""The judgement: each audited record's fate, the anomalies, the summaries per subscription, the nack fates.

It sees only the Prepared frames (spark.prepare), never headers or payloads, so the rules of the
contract read here without the cost of parsing. The one large shuffle is _fates; every other side
is small and joins by broadcast, except the order check of exclusive and failover subscriptions
(_order_anomalies), which must sort their deliveries and so shuffles their fates once more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F  # noqa: N812
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from spark.columns import expected_due
from spark.keys import key_fates
from spark.model import (
    ANOMALY_SCHEMA,
    DEAD_LETTER_SUBSCRIPTION,
    KEYS,
    AuditParams,
    AuditResult,
    AuditRoute,
    Prepared,
    SubscriptionSummary,
    routes_frame,
)
from spark.timeline import build_timeline


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
    null_long, null_str = F.lit(None).cast("long"), F.lit(None).cast("string")
    route_cols = routes.select("topic", "subscription", "ordered", "delays_enabled", "fixed_delay_ms")
    inbound_rows = prepared.inbound.join(route_cols, "topic").select(
        *KEYS,
        "subscription",
        F.lit(0).alias("src"),
        "publish_ms",
        expected_due(F.col("ordered")).alias("due_ms"),
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
    rows = inbound_rows.unionAll(outbound_rows).unionAll(dead_rows)
    if prepared.keyed_log is not None:
        rows = rows.unionAll(_key_rows(prepared, routes))
    src = F.col("src")
    grouped = rows.groupBy(*KEYS, "subscription").agg(
        (F.count_if(src == 0) > 0).alias("has_inbound"),
        F.max("publish_ms").alias("publish_ms"),
        F.max("due_ms").alias("due_ms"),
        F.count_if(src == 1).alias("copies"),
        F.min("copy").alias("first"),
        F.min_by("code", F.when(src == 2, F.col("dlt_offset"))).alias("code"),
        F.max(F.when(src == 3, F.col("code"))).alias("key_fate"),
        F.max(F.when(src == 3, F.col("dlt_offset"))).alias("newest_offset"),
    )
    grace = F.lit(params.grace_ms)
    fates = grouped.select(
        *KEYS, "subscription", "has_inbound", "publish_ms", "due_ms", "copies", "code", "key_fate", "newest_offset",
        "first.*",
    )  # fmt: skip
    if prepared.overrides is not None:  # cancels and reschedules: a new expected fate (contract section 5)
        fates = fates.join(F.broadcast(prepared.overrides), [*KEYS, "subscription"], "left").withColumn(
            "due_ms", F.coalesce(F.col("new_due_ms"), F.col("due_ms"))
        )
    else:
        fates = fates.withColumns({"override": F.lit(None).cast("string"), "new_due_ms": F.lit(None).cast("long")})
    override = F.col("override")
    return (
        fates.withColumn("is_rejected", F.col("code").isNotNull())
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
            .when((override == "cancelled") & F.col("is_delivered"), "delivered_after_cancel")
            .when(override == "cancelled", "cancelled")
            .when(F.col("key_fate").isNotNull() & F.col("is_delivered"), "delivered_replaced")
            .when(F.col("key_fate").isNotNull(), F.col("key_fate"))
            .when(
                (override == "rescheduled") & F.col("is_delivered") & (F.col("delivered_ms") < F.col("new_due_ms")),
                "rescheduled_early",
            )
            .when(F.col("is_delivered"), "delivered")
            .when(F.col("due_ms") + grace > F.lit(params.as_of_ms), "pending")
            .otherwise("missing"),
        )
    )


def _key_rows(prepared: Prepared, routes: DataFrame) -> DataFrame:
    """The records of keyed topics that the delay-honouring subscriptions are not owed (spark.keys),
    one row per such subscription, shaped for _fates' union: the fate in `code`, the offset of the
    record that replaced it in `dlt_offset`."""
    assert prepared.keyed_log is not None
    keyed = routes.where(F.col("keyed"))
    policies = keyed.groupBy("topic").agg(
        F.first("delays_enabled").alias("delays_enabled"),
        F.first("fixed_delay_ms").alias("fixed_delay_ms"),
        F.max(~F.col("ordered")).alias("honours_delays"),
    )
    fates = key_fates(prepared.keyed_log, prepared.dead_letter, policies)
    null_long = F.lit(None).cast("long")
    return fates.join(F.broadcast(keyed.where(~F.col("ordered")).select("topic", "subscription")), "topic").select(
        *KEYS,
        "subscription",
        F.lit(3).alias("src"),
        null_long.alias("publish_ms"),
        null_long.alias("due_ms"),
        F.lit(None).cast(_FIRST_TYPE).alias("copy"),
        F.col("key_fate").alias("code"),
        F.col("newest_offset").alias("dlt_offset"),
    )


ORDER_BLOCK = 1_000_000
"""Inbound offsets per sort of the order check. The records of one inbound partition are checked in
blocks of this many offsets, each sorted on its own, and the blocks are then chained by their last
record, so no task sorts a whole Kafka partition however large it grows."""


def _order_anomalies(fates: DataFrame, routes: DataFrame) -> list[DataFrame]:
    """The order check of exclusive and failover subscriptions (contract sections 2 and 4).

    The promise: one inbound partition's records arrive on one outbound partition (the inbound
    partition's own number, when the outbound topic has as many partitions), in inbound order.
    Two kinds of anomaly, one per record:

    * wrong_partition: a record's first delivery is on another outbound partition than its inbound
      partition's number. Checked only when the partition counts match: otherwise the sidecar
      partitions by key on purpose, and one inbound partition legitimately spreads over several.
    * out_of_order: a record's first delivery was written on its outbound partition before the
      delivery of the record that precedes it in inbound order (among the checked records of that
      inbound partition on that outbound partition). A record moved by k places is one anomaly,
      not k: each record is compared with its predecessor only. This holds on a keyed outbound
      topic too: one producer writes an inbound partition's records in read order, so each
      outbound partition receives a subsequence of them, still in order.

    What the check leaves out, and why (each is correct behaviour the sidecar must not be blamed for):

    * delayed records, for the order (not for the partition): a first delivery whose
      `delay-deliver-at` is after the publish time was sent at its deliver-at, in deliver-at order.
      On these subscriptions that happens only to records accepted while the subscription was
      shared or key_shared (a type change: decide once, contract section 2). An at-once delivery
      carries the publish time, so a delay header that these subscriptions ignored does not exempt
      a record. Early or misdated deliveries are the `early` check's business.
    * nack redeliveries (redelivery count > 0): they come back at the nack's deliver-at, by design.
    * copies after the first: only a record's first copy (lowest outbound position) is placed;
      the rest are duplicates (an at-least-once replay after a crash rewrites records already
      written, and is reported there).
    * dead-lettered records: the sidecar decided they go nowhere; one that was delivered anyway is
      already `rejected_and_delivered`. Records not (yet) delivered have no place to check.
    """
    ordered = F.broadcast(routes.where(F.col("ordered")).select("topic", "subscription", "same_partitions"))
    firsts = fates.where(F.col("has_inbound") & F.col("is_delivered") & ~F.col("is_rejected")).join(
        ordered, ["topic", "subscription"]
    )
    wrong = firsts.where(F.col("same_partitions") & (F.col("outbound_partition") != F.col("partition")))
    at_once = firsts.where(F.coalesce(F.col("deliver_at_ms") <= F.col("publish_ms"), F.lit(True))).withColumn(
        "block", F.floor(F.col("offset") / F.lit(ORDER_BLOCK))
    )
    # A lane is what must be in order: one inbound partition's records on one outbound partition.
    lane = ["topic", "partition", "subscription", "outbound_partition"]
    in_block = Window.partitionBy(*lane, "block").orderBy("offset")
    ends = at_once.groupBy(*lane, "block").agg(
        F.max("offset").alias("last_offset"), F.max_by("outbound_offset", "offset").alias("last_out")
    )
    across = Window.partitionBy(*lane).orderBy("block")
    chained = ends.select(
        *lane,
        "block",
        F.lag("last_offset").over(across).alias("block_prev_offset"),
        F.lag("last_out").over(across).alias("block_prev_out"),
    )
    checked = (
        at_once.withColumns(
            {"prev_offset": F.lag("offset").over(in_block), "prev_out": F.lag("outbound_offset").over(in_block)}
        )
        .join(F.broadcast(chained), [*lane, "block"], "left")
        .withColumns(
            {
                "prev_offset": F.coalesce(F.col("prev_offset"), F.col("block_prev_offset")),
                "prev_out": F.coalesce(F.col("prev_out"), F.col("block_prev_out")),
            }
        )
    )
    return [
        _anomaly(
            wrong,
            "wrong_partition",
            redelivery_count=F.lit(0),
            detail=F.concat(
                F.lit("on outbound partition "),
                F.col("outbound_partition").cast("string"),
                F.lit(", not "),
                F.col("partition").cast("string"),
                F.lit(" (the topics have as many partitions)"),
            ),
        ),
        _anomaly(
            checked.where(F.col("prev_out") > F.col("outbound_offset")),
            "out_of_order",
            redelivery_count=F.lit(0),
            detail=F.concat(
                F.lit("written before inbound offset "),
                F.col("prev_offset").cast("string"),
                F.lit(", which precedes it (outbound offset "),
                F.col("prev_out").cast("string"),
                F.lit(")"),
            ),
        ),
    ]


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
    nack_fates = _nack_fates(prepared.commands, published, redeliveries, params, prepared.nack_cancels)

    dlt_copy = Window.partitionBy(*KEYS).orderBy("dlt_partition", "dlt_offset")
    anomaly_parts = [
        _anomaly(audited.where(F.col("status") == "missing"), "missing", deliver_at_ms=F.col("due_ms")),
        _anomaly(
            audited.where(F.col("status") == "delivered_after_cancel"),
            "delivered_after_cancel",
            redelivery_count=F.lit(0),
            detail=F.lit("a cancel was answered 'cancelled' for this subscription, and it was delivered"),
        ),
        _anomaly(
            audited.where(F.col("status") == "rescheduled_early"),
            "rescheduled_early",
            redelivery_count=F.lit(0),
            detail=F.concat(
                F.lit("delivered "),
                (F.col("new_due_ms") - F.col("delivered_ms")).cast("string"),
                F.lit(" ms before the time it was rescheduled to"),
            ),
        ),
        _anomaly(
            audited.where(F.col("status") == "delivered_replaced"),
            "delivered_replaced",
            redelivery_count=F.lit(0),
            detail=F.when(F.col("key_fate") == "tombstone", F.lit("a tombstone of a keyed topic, delivered")).otherwise(
                F.concat(F.lit("replaced by offset "), F.col("newest_offset").cast("string"), F.lit(" of its key"))
            ),
        ),
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
    if any(r.ordered for r in routes):  # no sort at all when no subscription promises an order
        anomaly_parts += _order_anomalies(fates, routes_df)
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
        "out_of_order": sum(s.out_of_order for s in summaries),
        "wrong_partition": sum(s.wrong_partition for s in summaries),
        "delivered_after_cancel": sum(s.delivered_after_cancel for s in summaries),
        "rescheduled_early": sum(s.rescheduled_early for s in summaries),
        "delivered_replaced": sum(s.delivered_replaced for s in summaries),
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
    timeline = build_timeline(audited, anomalies, span)
    cached = [f for f in (fates, redeliveries, anomalies, nack_fates) if f is not None]
    return AuditResult(
        summaries,
        rejections,
        control_rejections,
        counts,
        anomalies,
        rejected_records,
        orphans,
        timeline=timeline,
        cached=cached,
    )


def _nack_fates(
    commands: DataFrame | None,
    published: DataFrame,
    redeliveries: DataFrame,
    params: AuditParams,
    cancels: DataFrame | None = None,
) -> DataFrame | None:
    """Each (record, subscription) with valid nack commands: its latest command and whether it was
    honoured. A cancel after the latest nack took its redelivery back: `cancelled`, not owed."""
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
    if cancels is not None:
        latest = latest.join(F.broadcast(cancels), [*KEYS, "subscription"], "left")
    else:
        latest = latest.withColumn("cancel_offset", F.lit(None).cast("long"))
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
            .when(F.col("cancel_offset") > F.col("control_offset"), "cancelled")
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
            F.count_if(F.col("override") == "cancelled").alias("cancelled"),
            F.count_if(F.col("override") == "rescheduled").alias("rescheduled"),
            F.count_if(F.col("key_fate") == "replaced").alias("replaced"),
            F.count_if(F.col("key_fate") == "tombstone").alias("tombstones"),
            *_percentiles("lateness_ms", "lateness"),
            F.min("publish_ms").alias("_first_publish_ms"),
            F.max("publish_ms").alias("_last_publish_ms"),
        )
    )
    per_subscription: list[bool | float | int | str] = [
        "duplicate",
        "early",
        "late",
        "out_of_order",
        "wrong_partition",
        "delivered_after_cancel",
        "rescheduled_early",
        "delivered_replaced",
    ]
    by_kind = (
        anomalies.where(F.col("kind").isin(*per_subscription))
        .groupBy("topic", "subscription")
        .pivot("kind", per_subscription)
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
