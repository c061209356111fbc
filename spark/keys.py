"""Keyed topics (`by_key: replace`, contract section 2): which records no delay-honouring
subscription is owed, worked out again from the inbound log alone.

The contract's rule, which the audit applies independently of the sidecar's key index:

    R (offset o) replaces its key's previous record P (deliver-at T) when P was delayed and no
    record of the partition up to o, R included, has a timestamp at or after T: the log's clock
    (the greatest timestamp so far) is still before T when R is read.

"Previous" counts the key's records that were not dead-lettered at intake, tombstones included (a
tombstone is never delayed, so it cannot be replaced), and the records of every key and the
sidecar's own count for the clock. A record dead-lettered because its topic left the policies
(TOPIC_REMOVED) was judged and kept first, so it counts. A tombstone with a key is not delivered
to those subscriptions at all.

How it runs at scale, with no task sorting a whole Kafka partition: the running maximum of the
timestamps comes from blocks of offsets, each sorted on its own, chained by their maxima (as the
order check chains its blocks). The log is read from its first retained offset: records that
retention deleted are not in the clock, which the sidecar, reading since before, did count.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F  # noqa: N812

from spark.columns import expected_due
from spark.model import KEYS

BLOCK = 1_000_000
"""Offsets per sort of the running maxima."""

REPLACED, TOMBSTONE = "replaced", "tombstone"
TOPIC_REMOVED = "TOPIC_REMOVED"
"""The code of a removed topic's dead letters (sidecar/dispatch/drain.py)."""


def _with_running_maxima(log: DataFrame) -> DataFrame:
    """`upto_ms`: the log's clock at each record, the greatest timestamp of the partition up to it,
    block by block."""
    stamp = F.greatest(F.col("publish_ms"), F.lit(0))  # the sidecar reads a missing timestamp as 0
    blocks = log.withColumns({"stamp": stamp, "block": F.floor(F.col("offset") / F.lit(BLOCK))})
    in_block = Window.partitionBy("topic", "partition", "block").orderBy("offset")
    blocks = blocks.withColumn(
        "block_upto", F.max("stamp").over(in_block.rowsBetween(Window.unboundedPreceding, Window.currentRow))
    )
    across = Window.partitionBy("topic", "partition").orderBy("block").rowsBetween(Window.unboundedPreceding, -1)
    earlier = (
        blocks.groupBy("topic", "partition", "block")
        .agg(F.max("stamp").alias("block_max"))
        .select("topic", "partition", "block", F.max("block_max").over(across).alias("earlier"))
    )
    return blocks.join(earlier, ["topic", "partition", "block"]).withColumn(
        "upto_ms",
        F.greatest("block_upto", "earlier"),  # greatest skips nulls
    )


def key_fates(log: DataFrame, dead_letter: DataFrame, policies: DataFrame) -> DataFrame:
    """topic, partition, offset, `key_fate` (`replaced` or `tombstone`) and `newest_offset` (the
    record that replaced it): the records of keyed topics that the delay-honouring subscriptions
    must not receive.

    `log`: every record of the keyed topics (spark.prepare's keyed log); `policies`: per keyed
    topic, delays_enabled, fixed_delay_ms and honours_delays (some subscription is neither exclusive
    nor failover)."""
    rows = _with_running_maxima(log.join(F.broadcast(policies), "topic"))
    # T for the delay-honouring subscriptions; null when the record is not delayed (due at publish).
    due = expected_due(~F.col("honours_delays"))
    rows = rows.withColumn("due_ms", F.when(due > F.col("publish_ms"), due))
    # A record dead-lettered at intake replaces nothing; one a removed topic's drain dead-lettered
    # (TOPIC_REMOVED) was pending, its key's newest, when the topic left: it counts as any other.
    at_intake = dead_letter.where(~F.col("code").eqNullSafe(F.lit(TOPIC_REMOVED))).select(*KEYS).distinct()
    keyed = rows.where(F.col("key").isNotNull()).join(at_intake, KEYS, "left_anti")
    by_key = Window.partitionBy("topic", "partition", "key").orderBy("offset")
    pairs = keyed.select(
        "topic",
        "partition",
        F.col("offset").alias("o"),
        "upto_ms",
        F.lag("offset").over(by_key).alias("p"),
        F.lag(F.when(~F.col("tombstone"), F.col("due_ms"))).over(by_key).alias("t"),
    )
    replaced = pairs.where(F.col("t").isNotNull() & (F.col("upto_ms") < F.col("t")))
    return replaced.select(
        "topic",
        "partition",
        F.col("p").alias("offset"),
        F.lit(REPLACED).alias("key_fate"),
        F.col("o").alias("newest_offset"),
    ).unionByName(
        keyed.where(F.col("tombstone")).select(
            *KEYS, F.lit(TOMBSTONE).alias("key_fate"), F.lit(None).cast("long").alias("newest_offset")
        )
    )
