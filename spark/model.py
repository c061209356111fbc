"""The audit's vocabulary: its inputs, parameters and results, and the Spark schemas they travel in.

Every phase (spark.prepare, spark.analysis, spark.timeline), the job and the report speak these
types, so they live apart from all of them: a module that only defines shapes imports no phase, and
no phase imports another just to name a type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

DEAD_LETTER_SUBSCRIPTION = "(dead-letter)"

KINDS = (
    "missing",
    "nack_missing",
    "duplicate",
    "rejected_and_delivered",
    "early",
    "late",
    "out_of_order",
    "wrong_partition",
    "delivered_after_cancel",
    "rescheduled_early",
    "delivered_replaced",
)
"""Every anomaly kind; `late` is reported but has no threshold by default. `out_of_order` and
`wrong_partition` are the order check of exclusive and failover subscriptions (spark.analysis)."""

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
        StructField("same_partitions", BooleanType(), False),
        StructField("keyed", BooleanType(), False),
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

OUTCOME_SCHEMA = StructType(
    [
        StructField("outcome", StringType()),
        StructField("type", StringType()),
        StructField("topic", StringType()),
        StructField("partition", LongType()),
        StructField("offset", LongType()),
        StructField("subscriptions", ArrayType(StringType())),
        StructField("nacks", ArrayType(StringType())),
        StructField("deliver_at", LongType()),
        StructField("command", StructType([StructField("partition", LongType()), StructField("offset", LongType())])),
    ]
)
"""The fields of a cancel or reschedule outcome the audit reads (contract section 5)."""

KEYS = ["topic", "partition", "offset"]


@dataclass(frozen=True)
class AuditRoute:
    """Where an inbound topic's records must go for one subscription, and the delay policy that applies."""

    topic: str
    subscription: str
    outbound: str
    dead_letter_topic: str
    ordered: bool = False
    """An exclusive or failover subscription: every record at once, in inbound order (contract section 2)."""
    delays_enabled: bool = True
    fixed_delay_ms: int = 0
    control_topic: str | None = None
    """The topic's own control topic in the policies (None: the sidecar's --control-topic)."""
    same_partitions: bool = True
    """The outbound topic has as many partitions as the inbound topic, so the sidecar writes each record
    on its inbound partition's number; otherwise it partitions by key and only per-key order holds
    (contract section 4). The job reads the counts from the cluster; in-memory callers say so here."""
    keyed: bool = False
    """`by_key: replace`: the newest record per key replaces the pending one (contract section 2)."""


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
    control_topics: tuple[str, ...] = ("delay-sidecar.control",)
    """Every control topic read into `control` (the default one and the topics' own)."""
    outcomes: DataFrame | None = None
    """`<control>.outcomes`: the answers to cancels and reschedules (contract section 5)."""


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
    out_of_order: int = 0
    wrong_partition: int = 0
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
    cancelled: int = 0
    """Records a cancel took back from this subscription (not expected on its outbound topic)."""
    rescheduled: int = 0
    """Records a reschedule moved (expected at the new time)."""
    delivered_after_cancel: int = 0
    rescheduled_early: int = 0
    replaced: int = 0
    """Records of a keyed topic that a newer record of their key replaced (not expected here)."""
    tombstones: int = 0
    """Tombstones of a keyed topic (not delivered to subscriptions that honour delays)."""
    delivered_replaced: int = 0


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
    cached: list[DataFrame] = field(default_factory=list)
    """What the analysis persisted, `anomalies` among them: `release` frees it once the result is
    written."""

    def release(self) -> None:
        """Unpersist what the analysis cached. A session that runs audit after audit (the chaos and
        churn runs' in-process audits) kept every audit's cached frames and their plans otherwise:
        heap used after GC grew 274, 474, 612, 683 MB over four audits of one small world, and in
        CI the third audit of a 1 GB driver spent its last 600 s in the garbage collector."""
        for frame in self.cached:
            frame.unpersist()
        self.cached.clear()

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
    overrides: DataFrame | None = None
    """Per (origin, subscription), what the latest cancel or reschedule that applied made of it:
    `override` (cancelled or rescheduled) and `new_due_ms` (rescheduled)."""
    nack_cancels: DataFrame | None = None
    """Origin, subscription, control_offset: cancels that took back the pending nack redeliveries
    of an already delivered record (the outcome's `nacks`); the nacks before them are not owed."""
    keyed_log: DataFrame | None = None
    """Every record of the keyed topics, the sidecar's own included: topic, partition, offset,
    publish_ms, requested_ms, key (null: none, empty, or the sidecar's own record), tombstone."""

    def frames(self) -> dict[str, DataFrame]:
        named = {"inbound": self.inbound, "outbound": self.outbound, "dead_letter": self.dead_letter}
        if self.commands is not None:
            named["control"] = self.commands
        if self.control_rejections is not None:
            named["control_dead_letter"] = self.control_rejections
        if self.overrides is not None:
            named["outcomes"] = self.overrides
        if self.keyed_log is not None:
            named["keyed_log"] = self.keyed_log
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
        (
            r.topic,
            r.subscription,
            r.outbound,
            r.dead_letter_topic,
            r.ordered,
            r.delays_enabled,
            int(r.fixed_delay_ms),
            r.same_partitions,
            r.keyed,
        )
        for r in routes
    ]
    return spark.createDataFrame(rows, ROUTE_SCHEMA)
