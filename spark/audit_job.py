"""The audit job: snapshot the topics' offsets, read them with Spark, judge, write the report, exit code.

    delay-sidecar audit --bootstrap-servers HOST:PORT --policies policies/ [flags]
    spark-submit spark/audit_job.py --bootstrap-servers HOST:PORT --policies policies/ [flags]

Exit codes: 0 every threshold met; 1 anomalies over a threshold (--max-missing, --max-duplicates,
--max-early, --max-late); 2 a usage or configuration error (nothing audited).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

if __package__ in (None, ""):  # `spark-submit spark/audit_job.py`: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka.admin import AdminClient
from pydantic import ValidationError
from pydantic_settings import CliApp
from pyspark.sql import DataFrame, SparkSession

from sidecar.errors import ConfigError, SidecarError
from sidecar.policy import load_policies
from spark.audit import AuditInputs, AuditParams, AuditResult, AuditRoute, run_audit
from spark.kafka_source import KafkaSourceError, kafka_schema, plan_ranges
from spark.report import print_summary, thresholds_report, write_chart
from spark.session import build_session, resolve_source
from spark.settings import AuditSettings

EXIT_OK = 0
EXIT_ANOMALIES = 1
EXIT_USAGE = 2

Ranges = dict[str, dict[int, tuple[int, int]]]


def parse_time(text: str, flag: str) -> int:
    """Epoch ms for `--from-time` / `--to-time`: epoch milliseconds or RFC 3339 with an offset."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        instant = datetime.fromisoformat(text.replace("z", "Z"))
    except ValueError:
        instant = None
    if instant is None or instant.tzinfo is None:
        raise ConfigError(f"--{flag}: expected epoch milliseconds or RFC 3339 with an offset, got {text!r}")
    return int(instant.timestamp() * 1000)


def audit_routes(settings: AuditSettings) -> list[AuditRoute]:
    """The routes to audit, from the policies or from --topics/--subscriptions/--routes."""
    if settings.policies is not None:
        policy = load_policies(settings.policies)
        topics = settings.topics or sorted(policy.topics)
        unknown = [t for t in topics if t not in policy.topics]
        if unknown:
            raise ConfigError(f"--topics: {', '.join(unknown)} not in the policies at {settings.policies}")
        return [
            AuditRoute(
                topic=t,
                subscription=sub.name,
                outbound=sub.outbound,
                dead_letter_topic=policy.topics[t].dead_letter_topic,
                ordered=sub.ordered,
                delays_enabled=policy.topics[t].delay.is_enabled,
                fixed_delay_ms=policy.topics[t].delay.fixed_ms,
            )
            for t in topics
            for sub in policy.topics[t].subscriptions
        ]
    if not settings.topics or not (settings.subscriptions or settings.routes):
        raise ConfigError("give --policies PATH, or --topics with --subscriptions (and --routes for other names)")
    outbound: dict[tuple[str, str], str] = {(t, s): f"{t}.{s}" for t in settings.topics for s in settings.subscriptions}
    for route in settings.routes:
        left, _, target = route.partition("=")
        topic, _, sub = left.partition("/")
        if not (topic and sub and target):
            raise ConfigError(f"--routes: expected TOPIC/SUBSCRIPTION=OUTBOUND, got {route!r}")
        outbound[(topic, sub)] = target
    dead: dict[str, str] = {}
    for item in settings.dead_letter_topics:
        topic, _, dlt = item.partition("=")
        if not (topic and dlt):
            raise ConfigError(f"--dead-letter-topics: expected TOPIC=DLT, got {item!r}")
        dead[topic] = dlt
    return [AuditRoute(t, s, o, dead.get(t, f"{t}.dlt")) for (t, s), o in sorted(outbound.items())]


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
            "absent_topics": self.absent,
        }


def existing_topics(kafka_options: dict[str, str]) -> set[str]:
    config = {k[len("kafka.") :]: v for k, v in kafka_options.items() if k.startswith("kafka.")}
    try:
        metadata = AdminClient(config).list_topics(timeout=20)
    except Exception as e:
        raise SidecarError(f"cannot reach Kafka at {config.get('bootstrap.servers')}: {e}") from e
    return {t for t, m in metadata.topics.items() if m.error is None}


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
    exists = existing_topics(kafka_options)
    inbound = sorted({r.topic for r in routes})
    missing_inbound = [t for t in inbound if t not in exists]
    if missing_inbound:
        raise ConfigError(f"inbound topic(s) {', '.join(missing_inbound)} do not exist on the cluster")
    wanted = {
        "outbound": sorted({r.outbound for r in routes}),
        "dead_letter": sorted({r.dead_letter_topic for r in routes}),
        "control": [settings.control_topic] if settings.control_topic else [],
        "control_dead_letter": [settings.control_dead_letter_topic] if settings.control_topic else [],
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
        name: resolve(kafka_options, [t for t in topics if t in exists], later) for name, topics in wanted.items()
    }
    return Snapshot(
        inbound_ranges,
        ranges["outbound"],
        ranges["dead_letter"],
        ranges["control"],
        ranges["control_dead_letter"],
        as_of_ms,
        absent,
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
    # Only committed records count: an aborted write of the sidecar was never delivered.
    options["kafka.isolation.level"] = "read_committed"
    return options


def session_for(settings: AuditSettings) -> SparkSession:
    master = settings.master
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = "local[*]"  # not under spark-submit: run here
    return build_session(master, driver_memory=settings.driver_memory, shuffle_partitions=settings.shuffle_partitions)


@dataclass
class JobOutcome:
    exit_code: int
    report: dict[str, Any]
    result: AuditResult


def audit(settings: AuditSettings, spark: SparkSession | None = None, out: TextIO | None = None) -> JobOutcome:
    """Run the whole audit; `spark` lets tests share one session."""

    started = time.monotonic()
    kafka_options = source_options(settings)
    routes = audit_routes(settings)
    if not routes:
        raise ConfigError("nothing to audit: the policies or flags name no subscription")
    from_ms = parse_time(settings.from_time, "from-time") if settings.from_time else None
    to_ms = parse_time(settings.to_time, "to-time") if settings.to_time else None
    snapshot = take_snapshot(settings, routes, kafka_options, from_ms)
    spark = spark or session_for(settings)
    fmt = resolve_source(spark, settings.source)
    read_options = dict(kafka_options)
    if settings.min_partitions:
        read_options["minPartitions"] = str(settings.min_partitions)
    inputs = AuditInputs(
        inbound=read_topics(spark, fmt, read_options, snapshot.inbound),
        outbound=read_topics(spark, fmt, read_options, snapshot.outbound),
        dead_letter=read_topics(spark, fmt, read_options, snapshot.dead_letter),
        control=read_topics(spark, fmt, read_options, snapshot.control) if settings.control_topic else None,
        control_dead_letter=read_topics(spark, fmt, read_options, snapshot.control_dead_letter)
        if settings.control_topic
        else None,
        control_topic=settings.control_topic,
    )
    params = AuditParams(as_of_ms=snapshot.as_of_ms, grace_ms=settings.grace_ms, from_ms=from_ms, to_ms=to_ms)
    result = run_audit(spark, inputs, routes, params)

    output = settings.output_dir
    output.mkdir(parents=True, exist_ok=True)
    result.anomalies.coalesce(1).write.mode("overwrite").parquet(str(output / "anomalies"))
    result.rejected_records.coalesce(1).write.mode("overwrite").parquet(str(output / "rejections"))
    write_chart(result, output / "lateness.png")
    thresholds, passed = thresholds_report(result, settings)
    report = {
        "passed": passed,
        "source": "built-in kafka" if fmt == "kafka" else "python (confluent-kafka)",
        "grace_ms": settings.grace_ms,
        "from_ms": from_ms,
        "to_ms": to_ms,
        "thresholds": thresholds,
        "snapshot": snapshot.as_json(),
        **result.as_json(),
        "outputs": {
            "anomalies": str(output / "anomalies"),
            "rejections": str(output / "rejections"),
            "chart": str(output / "lateness.png"),
        },
        "wall_time_s": round(time.monotonic() - started, 3),
    }
    (output / "report.json").write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    print_summary(result, report, settings.show_anomalies, out or sys.stdout)
    return JobOutcome(EXIT_OK if passed else EXIT_ANOMALIES, report, result)


def run_job(settings: AuditSettings, spark: SparkSession | None = None) -> int:
    """The exit code of an audit; errors a person can fix print one line and give 2."""
    try:
        return audit(settings, spark).exit_code
    except SidecarError as e:
        print(f"delay-sidecar audit: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def main(argv: list[str] | None = None) -> None:
    """Entry point of `spark-submit spark/audit_job.py ...` (same flags as `delay-sidecar audit`)."""

    try:
        settings = CliApp.run(AuditSettings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        print(f"delay-sidecar audit: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    sys.exit(run_job(settings))


if __name__ == "__main__":
    main()
