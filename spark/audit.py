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
* keyed topics (`by_key: replace`, contract section 2): a record that a newer record of its key
  replaced, or a tombstone, is not owed to the delay-honouring subscriptions (`replaced`,
  `tombstone`); delivered there, it is `delivered_replaced`. The rule is applied to the inbound
  log in spark.keys, independently of the sidecar's key index.
* order (exclusive and failover subscriptions only): one inbound partition's records on the outbound
  partition of the same number (when the topics have as many partitions; otherwise the sidecar
  partitions by key), their at-once first deliveries in inbound offset order; `wrong_partition`
  and `out_of_order`. Delayed records, nack redeliveries, extra copies and dead-lettered records
  are exempt, for the reasons in spark.analysis._order_anomalies.

How it runs (the shape matters at a billion records): every input is first reduced to a few
columns (prepare: the headers parsed once, the payloads dropped) and cached; that is the read.
Then ONE shuffle brings each record's inbound row, its first deliveries and its dead-letter rows
together per (record, subscription), and a hash aggregation judges them. Everything else
(redeliveries, duplicates, early deliveries, nack commands) is small and joins by broadcast; only the
order check sorts, and only the first deliveries of exclusive and failover subscriptions.

Where the parts live: spark.model (inputs, results, schemas), spark.columns (header
expressions), spark.prepare (the read), spark.analysis (the judgement), spark.keys (the keyed
topics' replacements) and spark.timeline (the chart's series). run_audit runs them in order, for
callers that need no timings.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import SparkSession

from spark.analysis import analyse
from spark.model import AuditInputs, AuditParams, AuditResult, AuditRoute
from spark.prepare import prepare


def run_audit(
    spark: SparkSession, inputs: AuditInputs, routes: Sequence[AuditRoute], params: AuditParams
) -> AuditResult:
    """Prepare, read and judge in one call (the job splits these steps to time them)."""
    prepared = prepare(spark, inputs, routes, params).persist()
    records_read = prepared.materialise()
    result = analyse(spark, prepared, routes, params)
    result.records_read = records_read
    return result
