"""The read phase: each input reduced to the few columns the audit needs, before anything is judged.

The only place that knows the Kafka source's schema, the header names and the nack command's JSON:
what comes after works on the Prepared frames, which are cached once and read many times.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812

from sidecar.control.cancels import COMMAND_BY
from sidecar.outbound.records import (
    DELIVER_AT,
    ERROR_CODE,
    ERROR_MESSAGE,
    ORIGIN,
    ORIGIN_OFFSET,
    ORIGIN_PARTITION,
    ORIGIN_TOPIC,
    REDELIVERY_COUNT,
)
from spark.columns import header_long, header_text, with_requested_deliver_at
from spark.model import NACK_SCHEMA, OUTCOME_SCHEMA, AuditInputs, AuditParams, AuditRoute, Prepared, routes_frame


def _origin() -> list[Column]:
    """The origin in either header form: `delay-origin: topic/partition/offset` (compact, the default
    for deliveries) or the v1 form's three headers (dead letters, and `--outbound-headers v1`)."""
    compact = F.split(header_text(ORIGIN), "/")  # topic names hold no "/": three parts
    has = F.size(compact) == 3

    def part(i: int) -> Column:
        return F.when(has, F.element_at(compact, i))

    return [
        F.coalesce(part(1), header_text(ORIGIN_TOPIC)).alias("topic"),
        F.coalesce(part(2).try_cast("long"), header_long(ORIGIN_PARTITION)).cast("int").alias("partition"),
        F.coalesce(part(3).try_cast("long"), header_long(ORIGIN_OFFSET)).alias("offset"),
    ]


def prepare(spark: SparkSession, inputs: AuditInputs, routes: Sequence[AuditRoute], params: AuditParams) -> Prepared:
    """Each input reduced to the audit's columns (lazy: persist() and materialise() read them)."""
    routes_df = F.broadcast(routes_frame(spark, routes))
    topics = routes_df.select("topic").distinct()
    everything = inputs.inbound.join(topics, "topic", "left_semi")
    # Cancel and reschedule requests and facts, and clock records, that sidecars write into inbound
    # partitions (contract sections 2 and 5): never messages, whatever group wrote them.
    own = F.coalesce(F.get(F.col("headers.key"), 0) == F.lit(COMMAND_BY), F.lit(False))
    inbound = everything.where(~own)
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
    overrides = nack_cancels = None
    if inputs.outcomes is not None:
        outcomes = inputs.outcomes.select(F.from_json(F.col("value").cast("string"), OUTCOME_SCHEMA).alias("o"))
        overrides, nack_cancels = _overrides(outcomes), _nack_cancels(outcomes)
    keyed_topics = sorted({r.topic for r in routes if r.keyed})
    keyed_log = None
    if keyed_topics:  # the whole log of those topics: every record's timestamp counts in the rule
        keyed_log = with_requested_deliver_at(
            everything.where(F.col("topic").isin(keyed_topics)).select(
                "topic",
                "partition",
                "offset",
                F.unix_millis(F.col("timestamp")).alias("publish_ms"),
                "headers",
                F.when((F.length("key") > 0) & ~own, F.col("key")).alias("key"),
                F.col("value").isNull().alias("tombstone"),
            )
        ).drop("headers")
    return Prepared(inb, out, dlt, commands, refused, overrides, nack_cancels, keyed_log)


def _nack_cancels(outcomes: DataFrame) -> DataFrame:
    """Per (origin, subscription), the latest cancel that took back a pending nack redelivery."""
    return (
        outcomes.where(F.col("o.outcome") == "cancelled")
        .select(
            F.col("o.topic").alias("topic"),
            F.col("o.partition").cast("int").alias("partition"),
            F.col("o.offset").alias("offset"),
            F.explode("o.nacks").alias("subscription"),
            F.col("o.command.offset").alias("cancel_offset"),
        )
        .groupBy("topic", "partition", "offset", "subscription")
        .agg(F.max("cancel_offset").alias("cancel_offset"))
    )


def _overrides(outcomes: DataFrame) -> DataFrame:
    """Per (origin, subscription), the latest cancel or reschedule that applied to it.

    Commands about one message share a key, hence a control partition, so the command's offset orders
    them: a cancel after a reschedule leaves the message cancelled, a reschedule after another moves it
    again. Outcomes that changed nothing (too-late, rejected, unknown-message) are not overrides, nor
    is a cancel for a subscription whose first delivery had gone out (it took back a nack, `nacks`)."""
    parsed = outcomes.where(F.col("o.outcome").isin("cancelled", "rescheduled"))
    per_subscription = parsed.select(
        F.col("o.topic").alias("topic"),
        F.col("o.partition").cast("int").alias("partition"),
        F.col("o.offset").alias("offset"),
        F.explode(F.array_except("o.subscriptions", F.coalesce("o.nacks", F.array().cast("array<string>")))).alias(
            "subscription"
        ),
        F.struct(
            F.col("o.command.offset").alias("position"),
            F.col("o.outcome").alias("override"),
            F.when(F.col("o.outcome") == "rescheduled", F.col("o.deliver_at")).alias("new_due_ms"),
        ).alias("latest"),
    )
    return (
        per_subscription.groupBy("topic", "partition", "offset", "subscription")
        .agg(F.max("latest").alias("latest"))
        .select("topic", "partition", "offset", "subscription", "latest.override", "latest.new_due_ms")
    )


def _parsed_control(inputs: AuditInputs) -> DataFrame | None:
    if inputs.control is None:
        return None
    commands = inputs.control.select(
        F.col("topic").alias("control_topic"),
        F.col("partition").alias("control_partition"),
        F.col("offset").alias("control_offset"),
        F.unix_millis(F.col("timestamp")).alias("command_ms"),
        F.from_json(F.col("value").cast("string"), NACK_SCHEMA).alias("c"),
    ).where(F.col("c.type") == "nack")  # the sidecar's "accepted" records share the topic: not commands
    if inputs.control_dead_letter is not None:
        refused = (
            inputs.control_dead_letter.select(
                header_text(ORIGIN_TOPIC).alias("control_topic"),
                header_long(ORIGIN_PARTITION).cast("int").alias("control_partition"),
                header_long(ORIGIN_OFFSET).alias("control_offset"),
            )
        ).where(F.col("control_topic").isin(list(inputs.control_topics)))
        commands = commands.join(refused, ["control_topic", "control_partition", "control_offset"], "left_anti")
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
