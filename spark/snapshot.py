"""The records the audit reads: the topics' offsets pinned once, and the DataFrames over exactly those offsets.

Apart from the job because it is the audit's only conversation with the cluster outside Spark (an
AdminClient and the Kafka source's planner): the job decides when to take the snapshot, this
module decides what it holds, so every Spark job of one audit sees the same records.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka.admin import AdminClient
from pyspark.sql import DataFrame, SparkSession

from sidecar.errors import ConfigError, SidecarError
from spark.kafka_source import KafkaSourceError, kafka_schema, plan_ranges
from spark.model import AuditRoute
from spark.settings import AuditSettings

Ranges = dict[str, dict[int, tuple[int, int]]]


@dataclass
class Snapshot:
    """The offset ranges read, resolved once so every Spark job sees the same records."""

    inbound: Ranges
    outbound: Ranges
    dead_letter: Ranges
    control: Ranges
    control_dead_letter: Ranges
    as_of_ms: int
    absent: list[str] = field(default_factory=list)
    partitions: dict[str, int] = field(default_factory=dict)
    """Partitions per existing topic read, from the cluster's metadata: whether an outbound topic
    keeps its inbound topic's partition numbers depends on both counts (contract section 4)."""
    outcomes: Ranges = field(default_factory=dict)
    """Cancel and reschedule outcomes: read whole, whatever the time range (a cancel may be older)."""

    def as_json(self) -> dict[str, Any]:
        def show(r: Ranges) -> dict[str, dict[str, list[int]]]:
            return {t: {str(p): [s, e] for p, (s, e) in sorted(parts.items())} for t, parts in sorted(r.items())}

        return {
            "as_of_ms": self.as_of_ms,
            "inbound": show(self.inbound),
            "outbound": show(self.outbound),
            "dead_letter": show(self.dead_letter),
            "control": show(self.control),
            "control_dead_letter": show(self.control_dead_letter),
            "outcomes": show(self.outcomes),
            "absent_topics": self.absent,
            "partitions": dict(sorted(self.partitions.items())),
        }


CONSUMER_ONLY = ("isolation.level",)
"""Consumer properties among the read options; an AdminClient given them logs that it ignores them."""
METADATA_TIMEOUT_S = 60
"""The audit's first request to the cluster. A single node that fenced itself after a stall of its
controller (a loaded machine, 26 s and more without an answer) failed an audit that waited 20 s."""


def existing_topics(kafka_options: dict[str, str]) -> set[str]:
    """For callers that only need to know which topics exist (the partition counts cost nothing more)."""
    return set(topic_partitions(kafka_options))


def topic_partitions(kafka_options: dict[str, str], timeout_s: float = METADATA_TIMEOUT_S) -> dict[str, int]:
    """Every topic of the cluster with its partition count (one metadata request)."""
    config = {
        k[len("kafka.") :]: v
        for k, v in kafka_options.items()
        if k.startswith("kafka.") and k[len("kafka.") :] not in CONSUMER_ONLY
    }
    try:
        metadata = AdminClient(config).list_topics(timeout=timeout_s)
    except Exception as e:
        raise SidecarError(
            f"cannot reach Kafka at {config.get('bootstrap.servers')} in {timeout_s:.0f} s: {e}; "
            "check --bootstrap-servers and that the cluster is up"
        ) from e
    return {t: len(m.partitions) for t, m in metadata.topics.items() if m.error is None}


def resolve(kafka_options: dict[str, str], topics: list[str], extra: dict[str, str]) -> Ranges:
    if not topics:
        return {}
    try:
        ranges = plan_ranges({**kafka_options, "subscribe": ",".join(topics), **extra}, keep_empty=True)
    except KafkaSourceError as e:
        raise ConfigError(str(e)) from None
    out: Ranges = {}
    for r in ranges:
        out.setdefault(r.topic, {})[r.partition] = (r.start, r.end)
    return out


def take_snapshot(
    settings: AuditSettings, routes: list[AuditRoute], kafka_options: dict[str, str], from_ms: int | None
) -> Snapshot:
    exists = topic_partitions(kafka_options)
    inbound = sorted({r.topic for r in routes})
    missing_inbound = [t for t in inbound if t not in exists]
    if missing_inbound:
        raise ConfigError(f"inbound topic(s) {', '.join(missing_inbound)} do not exist on the cluster")
    # Topics with a control topic of their own (policy control_topic) take commands there, and
    # answer them on its dead-letter and outcomes topics (contract section 5).
    own = sorted({r.control_topic for r in routes if r.control_topic and r.control_topic != settings.control_topic})
    wanted = {
        "outbound": sorted({r.outbound for r in routes}),
        "dead_letter": sorted({r.dead_letter_topic for r in routes}),
        "control": [settings.control_topic, *own] if settings.control_topic else [],
        "control_dead_letter": [settings.command_dead_letter_topic, *(f"{c}.dlt" for c in own)]
        if settings.control_topic
        else [],
        "outcomes": [settings.command_outcomes_topic, *(f"{c}.outcomes" for c in own)]
        if settings.command_outcomes_topic
        else [],
    }
    absent = sorted(t for topics in wanted.values() for t in topics if t not in exists)
    inbound_options = {"startingOffsets": settings.starting_offsets, "endingOffsets": settings.ending_offsets}
    if from_ms is not None and settings.starting_offsets == "earliest":
        inbound_options["startingTimestamp"] = str(from_ms)
    inbound_ranges = resolve(kafka_options, inbound, inbound_options)
    # Records due up to now must be on the outbound topics read after this instant.
    as_of_ms = int(time.time() * 1000)
    later: dict[str, str] = {}
    if from_ms is not None:
        later["startingTimestamp"] = str(max(from_ms - settings.grace_ms, 0))
    ranges = {
        name: resolve(kafka_options, [t for t in topics if t in exists], {} if name == "outcomes" else later)
        for name, topics in wanted.items()
    }
    return Snapshot(
        inbound_ranges,
        ranges["outbound"],
        ranges["dead_letter"],
        ranges["control"],
        ranges["control_dead_letter"],
        as_of_ms,
        absent,
        {t: n for t, n in exists.items() if t in set(inbound).union(*wanted.values())},
        ranges["outcomes"],
    )


def read_topics(spark: SparkSession, fmt: str, kafka_options: dict[str, str], ranges: Ranges) -> DataFrame:
    """The records in `ranges` with the Kafka source schema (headers included), from either source."""
    if not ranges:
        return spark.createDataFrame([], kafka_schema(include_headers=True))
    reader = spark.read.format(fmt)
    for key, value in kafka_options.items():
        reader = reader.option(key, value)
    return (
        reader.option("subscribe", ",".join(sorted(ranges)))
        .option(
            "startingOffsets",
            json.dumps({t: {str(p): s for p, (s, _) in parts.items()} for t, parts in ranges.items()}),
        )
        .option(
            "endingOffsets", json.dumps({t: {str(p): e for p, (_, e) in parts.items()} for t, parts in ranges.items()})
        )
        .option("includeHeaders", "true")
        .load()
    )


def source_options(settings: AuditSettings) -> dict[str, str]:
    if not settings.bootstrap_servers:
        raise ConfigError(
            "--bootstrap-servers HOST:PORT (or DELAY_SIDECAR_BOOTSTRAP_SERVERS) is required: the audit reads an "
            "existing cluster and starts no broker (`delay-sidecar broker` runs one locally)"
        )
    options = {f"kafka.{k}": str(v) for k, v in settings.client_config(settings.bootstrap_servers).items()}
    # By default only committed records count: an aborted write of the sidecar was never delivered.
    options["kafka.isolation.level"] = settings.isolation_level
    return options
