"""Keyed topics (`by_key: replace`, contract section 2): which records no delay-honouring
subscription is owed, worked out again from the inbound log alone.

The contract's rule, which the audit applies independently of the sidecar's key index:

    R (offset o) replaces its key's previous record P (offset p, deliver-at T) when P was delayed
    and no record of the partition from p to o, P and R included, has a timestamp at or after T.

"Previous" counts the key's records that were not dead-lettered, tombstones included (a tombstone
is never delayed, so it cannot be replaced), and the records of every key and the sidecar's own
count for the timestamps. A tombstone with a key is not delivered to those subscriptions at all.

How it runs at scale, with no task sorting a whole Kafka partition: the greatest timestamp before
each record and up to it come from blocks of offsets, each sorted on its own, chained by their
maxima (as the order check chains its blocks). When nothing before P reached T, the range from p
to o stays below T exactly when everything up to o does, so one comparison decides. Only when an
earlier record was already stamped at or past T (a producer clock ahead of another's) is the range
itself read: its blocks joined to the log, for those pairs alone.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F  # noqa: N812

from spark.model import KEYS

BLOCK = 1_000_000
"""Offsets per sort of the running maxima."""

REPLACED, TOMBSTONE = "replaced", "tombstone"


def _delayed_until(policies: DataFrame) -> Column:
    """T for the delay-honouring subscriptions, null when the record is not delayed (as intake decides)."""
    publish, requested = F.col("publish_ms"), F.col("requested_ms")
    return (
        F.when(~F.col("delays_enabled") | ~F.col("honours_delays"), None)
        .when(F.col("fixed_delay_ms") > 0, publish + F.col("fixed_delay_ms"))
        .when(requested > publish, requested)
    )


def _with_running_maxima(log: DataFrame) -> DataFrame:
    """`before_ms` (the greatest timestamp at lower offsets of the partition) and `upto_ms` (that
    record's too), block by block."""
    stamp = F.greatest(F.col("publish_ms"), F.lit(0))  # the sidecar reads a missing timestamp as 0
    blocks = log.withColumns({"stamp": stamp, "block": F.floor(F.col("offset") / F.lit(BLOCK))})
    in_block = Window.partitionBy("topic", "partition", "block").orderBy("offset")
    blocks = blocks.withColumns(
        {
            "block_before": F.max("stamp").over(in_block.rowsBetween(Window.unboundedPreceding, -1)),
            "block_upto": F.max("stamp").over(in_block.rowsBetween(Window.unboundedPreceding, Window.currentRow)),
        }
    )
    across = Window.partitionBy("topic", "partition").orderBy("block").rowsBetween(Window.unboundedPreceding, -1)
    earlier = (
        blocks.groupBy("topic", "partition", "block")
        .agg(F.max("stamp").alias("block_max"))
        .select("topic", "partition", "block", F.max("block_max").over(across).alias("earlier"))
    )
    return blocks.join(F.broadcast(earlier), ["topic", "partition", "block"]).withColumns(
        {
            "before_ms": F.greatest("block_before", "earlier"),  # greatest skips nulls
            "upto_ms": F.greatest("block_upto", "earlier"),
        }
    )


def key_fates(log: DataFrame, dead_letter: DataFrame, policies: DataFrame) -> DataFrame:
    """topic, partition, offset, `key_fate` (`replaced` or `tombstone`) and `newest_offset` (the
    record that replaced it): the records of keyed topics that the delay-honouring subscriptions
    must not receive.

    `log`: every record of the keyed topics (spark.prepare's keyed log); `policies`: per keyed
    topic, delays_enabled, fixed_delay_ms and honours_delays (some subscription is neither exclusive
    nor failover)."""
    rows = _with_running_maxima(log.join(F.broadcast(policies), "topic"))
    rows = rows.withColumn("due_ms", _delayed_until(policies))
    keyed = rows.where(F.col("key").isNotNull()).join(dead_letter.select(*KEYS).distinct(), KEYS, "left_anti")
    by_key = Window.partitionBy("topic", "partition", "key").orderBy("offset")
    pairs = keyed.select(
        "topic",
        "partition",
        F.col("offset").alias("o"),
        "upto_ms",
        F.lag("offset").over(by_key).alias("p"),
        F.lag(F.when(~F.col("tombstone"), F.col("due_ms"))).over(by_key).alias("t"),
        F.lag("before_ms").over(by_key).alias("p_before_ms"),
    ).where(F.col("t").isNotNull())
    clear_before = F.coalesce(F.col("p_before_ms") < F.col("t"), F.lit(True))
    plain = pairs.where(clear_before & (F.col("upto_ms") < F.col("t")))
    skewed = pairs.where(~clear_before)
    ranges = skewed.select(
        "topic",
        "partition",
        "p",
        "o",
        "t",
        F.explode(F.sequence(F.floor(F.col("p") / F.lit(BLOCK)), F.floor(F.col("o") / F.lit(BLOCK)))).alias("block"),
    )
    read = (
        ranges.join(rows.select("topic", "partition", "block", "offset", "stamp"), ["topic", "partition", "block"])
        .where(F.col("offset").between(F.col("p"), F.col("o")))
        .groupBy("topic", "partition", "p", "o", "t")
        .agg(F.max("stamp").alias("range_max"))
        .where(F.col("range_max") < F.col("t"))
    )
    replaced = plain.select("topic", "partition", "p", "o").unionByName(read.select("topic", "partition", "p", "o"))
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
