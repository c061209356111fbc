"""The audit job: snapshot the topics' offsets, read them with Spark, judge, write the report, exit code.

    delay-sidecar audit --bootstrap-servers HOST:PORT --policies policies/ [flags]
    spark-submit [--master URL --packages ...] spark/audit_job.py --bootstrap-servers HOST:PORT --policies policies/

Exit codes: 0 every threshold met; 1 anomalies over a threshold (--max-missing, --max-duplicates,
--max-early, --max-late, --max-out-of-order); 2 the audit could not run, whatever the cause (a usage
or configuration error, an unreachable cluster, a crash inside Spark), with the reason on stderr.
"""

# ruff: noqa: E402 (under spark-submit the interpreter is checked, and maybe replaced, before the imports)
from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

EXIT_OK = 0
EXIT_ANOMALIES = 1
EXIT_CANNOT_RUN = 2
EXIT_USAGE = EXIT_CANNOT_RUN


def _reexec_in_project_venv() -> None:
    """Under `spark-submit spark/audit_job.py`, Spark starts the driver with `python3` from PATH.

    When that interpreter lacks the audit's packages and the project's .venv has them, run this
    script again with the venv's interpreter: it inherits the gateway of the JVM spark-submit
    started (PYSPARK_GATEWAY_* variables), so nothing is lost.
    """
    root = Path(__file__).resolve().parent.parent
    venv_python = root / ".venv" / "bin" / "python"
    try:
        import confluent_kafka  # noqa: F401, PLC0415
        import pyarrow  # noqa: F401, PLC0415
        import pydantic_settings  # noqa: F401, PLC0415
        import pyspark  # noqa: F401, PLC0415
    except ImportError as e:
        if venv_python.is_file() and Path(sys.executable).resolve() != venv_python.resolve():
            os.environ.setdefault("PYSPARK_PYTHON", str(venv_python))  # and the Python workers too
            os.execv(str(venv_python), [str(venv_python), str(Path(__file__).resolve()), *sys.argv[1:]])
        print(
            f"delay-sidecar audit: error: {sys.executable} cannot import {e.name}: run spark-submit with "
            "--conf spark.pyspark.python=PATH/TO/VENV/bin/python (a Python with the project's [spark] extras)",
            file=sys.stderr,
        )
        sys.exit(EXIT_CANNOT_RUN)


if __package__ in (None, ""):  # `spark-submit spark/audit_job.py`: make the project importable
    _reexec_in_project_venv()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import ValidationError
from pydantic_settings import CliApp
from pyspark.sql import SparkSession

from sidecar.errors import ConfigError, SidecarError
from sidecar.logs import setup_logging
from sidecar.policy import load_policies
from spark.analysis import analyse
from spark.kafka_source import KafkaSourceError
from spark.model import AuditInputs, AuditParams, AuditResult, AuditRoute
from spark.prepare import prepare
from spark.report import anomaly_rows, print_summary, thresholds_report, write_chart, write_html
from spark.session import SourceDecision, build_session, resolve_source
from spark.settings import AuditSettings
from spark.snapshot import read_topics, source_options, take_snapshot

logger = logging.getLogger(__name__)


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
                control_topic=policy.topics[t].control_topic,
                keyed=policy.topics[t].delay.keyed,
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


def with_partition_layout(routes: list[AuditRoute], partitions: dict[str, int]) -> list[AuditRoute]:
    """Whether each outbound topic keeps the inbound partition numbers, decided as the sidecar does.

    The sidecar writes a record on its inbound partition's number only when the outbound topic has
    as many partitions as the inbound one, and partitions by key otherwise (contract section 4). The
    order check must not blame a keyed topic for spreading one inbound partition. An outbound topic
    that does not exist holds nothing to check, so it keeps the default.
    """
    return [
        replace(r, same_partitions=partitions[r.outbound] == partitions[r.topic])
        if r.outbound in partitions and r.topic in partitions
        else r
        for r in routes
    ]


CONF_KEY = re.compile(r"^[A-Za-z_][\w.\-]*$")


def spark_conf(entries: list[str]) -> dict[str, str]:
    """--conf KEY=VALUE entries as a dict.

    The command line splits list flags on commas, so `--conf spark.jars=a.jar,b.jar` arrives as two
    entries; a piece that does not start with KEY= belongs to the entry before it.
    """
    merged: list[str] = []
    for entry in entries:
        key, found, _ = entry.partition("=")
        if merged and not (found and CONF_KEY.match(key)):
            merged[-1] += "," + entry
        else:
            merged.append(entry)
    conf: dict[str, str] = {}
    for entry in merged:
        key, found, value = entry.partition("=")
        if not found or not CONF_KEY.match(key):
            raise ConfigError(
                f"--conf: expected KEY=VALUE (a Spark setting such as spark.executor.memory=4g), got {entry!r}"
            )
        conf[key] = value
    return conf


def under_spark_submit() -> bool:
    return "PYSPARK_GATEWAY_PORT" in os.environ


def session_for(settings: AuditSettings) -> SparkSession:
    """The audit's own session, with --master, --packages, --jars, --driver-memory and --conf, and
    Spark's Kafka connector (fetched once, cached) unless --source python."""
    conf = spark_conf(settings.conf)
    if under_spark_submit():
        given = [
            flag
            for flag, value in (
                ("--master", settings.master),
                ("--packages", settings.packages),
                ("--jars", settings.jars),
                ("--driver-memory", settings.driver_memory),
            )
            if value
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} after spark/audit_job.py come too late: spark-submit has started Spark. "
                "Give them to spark-submit, before the script"
            )
        return build_session(None, conf=conf)
    if settings.packages:
        conf["spark.jars.packages"] = settings.packages
    if settings.jars:
        conf["spark.jars"] = settings.jars
    return build_session(
        settings.master or "local[*]",
        driver_memory=settings.driver_memory,
        conf=conf,
        kafka_connector=settings.source != "python",
        connector_repository=settings.connector_repository,
    )


RECORDS_PER_SHUFFLE_PARTITION = 500_000
MAX_SHUFFLE_PARTITIONS = 4_000


def shuffle_partitions_for(records: int, cores: int) -> int:
    """Shuffle partitions sized to the input: Spark's default of 200 makes a few thousand records
    take minutes, and one partition per 500k records keeps each task's share of the one large
    shuffle (about 100 bytes a row) in the tens of megabytes. Never fewer than the cores."""
    return max(1, cores, min(MAX_SHUFFLE_PARTITIONS, math.ceil(records / RECORDS_PER_SHUFFLE_PARTITION)))


@contextmanager
def runtime_conf(spark: SparkSession, values: dict[str, str]) -> Iterator[None]:
    """Set SQL settings for this audit only (a session shared with tests gets its own back)."""
    before: dict[str, str | None] = {key: spark.conf.get(key, None) for key in values}
    for key, value in values.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


class Phases:
    """Wall time of each step of the audit, for the report and the benchmark."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(time.monotonic() - started, 3)
            logger.info("audit phase done phase=%s seconds=%.3f", name, self.seconds[name])


@dataclass
class JobOutcome:
    exit_code: int
    report: dict[str, Any]
    result: AuditResult


def audit(settings: AuditSettings, spark: SparkSession | None = None, out: TextIO | None = None) -> JobOutcome:
    """Run the whole audit; `spark` lets tests share one session (then --master, --packages, --jars,
    --driver-memory and static --conf settings are those of that session)."""

    started = time.monotonic()
    phases = Phases()
    with phases.phase("snapshot"):
        kafka_options = source_options(settings)
        routes = audit_routes(settings)
        if not routes:
            raise ConfigError("nothing to audit: the policies or flags name no subscription")
        from_ms = parse_time(settings.from_time, "from-time") if settings.from_time else None
        to_ms = parse_time(settings.to_time, "to-time") if settings.to_time else None
        conf = spark_conf(settings.conf)
        snapshot = take_snapshot(settings, routes, kafka_options, from_ms)
        routes = with_partition_layout(routes, snapshot.partitions)
    with phases.phase("spark_start"):
        spark = spark or session_for(settings)
        decision = resolve_source(spark, settings.source)
    records = sum(
        end - start
        for ranges in (snapshot.inbound, snapshot.outbound, snapshot.dead_letter, snapshot.control)
        for parts in ranges.values()
        for start, end in parts.values()
    )
    shuffle = settings.shuffle_partitions or (
        int(conf["spark.sql.shuffle.partitions"])
        if "spark.sql.shuffle.partitions" in conf
        else shuffle_partitions_for(records, spark.sparkContext.defaultParallelism)
    )
    read_options = dict(kafka_options)
    read_options["maxRecordsPerPartition"] = str(settings.max_records_per_partition)
    if settings.min_partitions:
        read_options["minPartitions"] = str(settings.min_partitions)
    fmt = decision.format
    inputs = AuditInputs(
        inbound=read_topics(spark, fmt, read_options, snapshot.inbound),
        outbound=read_topics(spark, fmt, read_options, snapshot.outbound),
        dead_letter=read_topics(spark, fmt, read_options, snapshot.dead_letter),
        control=read_topics(spark, fmt, read_options, snapshot.control) if settings.control_topic else None,
        control_dead_letter=read_topics(spark, fmt, read_options, snapshot.control_dead_letter)
        if settings.control_topic
        else None,
        control_topics=tuple(snapshot.control),
        outcomes=read_topics(spark, fmt, read_options, snapshot.outcomes) if settings.command_outcomes_topic else None,
    )
    params = AuditParams(as_of_ms=snapshot.as_of_ms, grace_ms=settings.grace_ms, from_ms=from_ms, to_ms=to_ms)
    output = settings.output_dir
    with runtime_conf(spark, {"spark.sql.shuffle.partitions": str(shuffle)}):
        prepared = prepare(spark, inputs, routes, params).persist()
        result: AuditResult | None = None
        try:
            with phases.phase("read"):
                records_read = prepared.materialise()
            with phases.phase("analysis"):
                result = analyse(spark, prepared, routes, params)
                result.records_read = records_read
                thresholds, passed = thresholds_report(result, settings)
            with phases.phase("write"):
                output.mkdir(parents=True, exist_ok=True)
                result.anomalies.coalesce(1).write.mode("overwrite").parquet(str(output / "anomalies"))
                result.rejected_records.coalesce(1).write.mode("overwrite").parquet(str(output / "rejections"))
                shown = anomaly_rows(result, settings.show_anomalies)
                write_chart(result, output / "report.png")
        finally:
            prepared.unpersist()
            if result is not None:
                result.release()
    assert result is not None  # the analysis ran, or its error was raised above
    report = {
        "passed": passed,
        "source": decision.label,
        "grace_ms": settings.grace_ms,
        "from_ms": from_ms,
        "to_ms": to_ms,
        "thresholds": thresholds,
        "spark": spark_report(spark, decision, settings, shuffle, conf),
        "snapshot": snapshot.as_json(),
        **result.as_json(),
        "outputs": {
            "report": str(output / "report.json"),
            "html": str(output / "report.html"),
            "chart": str(output / "report.png"),
            "anomalies": str(output / "anomalies"),
            "rejections": str(output / "rejections"),
        },
        "timings_s": phases.seconds,
        # Everything but this file and the HTML page that shows it: reading, judging, writing the anomalies.
        "wall_time_s": round(time.monotonic() - started, 3),
    }
    (output / "report.json").write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    write_html(result, report, shown, output / "report.html")
    print_summary(result, report, shown, out or sys.stdout)
    return JobOutcome(EXIT_OK if passed else EXIT_ANOMALIES, report, result)


def spark_report(
    spark: SparkSession, decision: SourceDecision, settings: AuditSettings, shuffle: int, conf: dict[str, str]
) -> dict[str, Any]:
    return {
        "version": decision.spark_version,
        "scala": decision.scala,
        "master": spark.sparkContext.master,
        "default_parallelism": spark.sparkContext.defaultParallelism,
        "jars": spark.sparkContext.getConf().get("spark.jars", ""),
        "packages": spark.sparkContext.getConf().get("spark.jars.packages", ""),
        "conf": conf,
        "kafka_format": decision.format,
        "kafka_connectors": [
            {"location": c.location, "version": c.version, "scala": c.scala} for c in decision.connectors
        ],
        "fallback_reason": decision.fallback_reason,
        "connector_repository": settings.connector_repository,
        "shuffle_partitions": shuffle,
        "max_records_per_partition": settings.max_records_per_partition,
        "isolation_level": settings.isolation_level,
    }


def _reason(error: BaseException) -> str:
    """One line that says what went wrong, from any exception (a JVM one included)."""
    java = getattr(error, "java_exception", None)
    if java is not None:
        try:
            return str(java.toString()).splitlines()[0]
        except Exception:  # the JVM is gone: fall back to the Python text
            pass
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"[:1000]


def run_job(settings: AuditSettings, spark: SparkSession | None = None) -> int:
    """The exit code of an audit: 0 passed, 1 anomalies over a threshold, 2 could not run (any cause)."""
    if not logging.getLogger().handlers:
        setup_logging("WARNING")
        logging.getLogger("spark").setLevel(logging.INFO)
    try:
        return audit(settings, spark).exit_code
    except (SidecarError, KafkaSourceError) as e:
        print(f"delay-sidecar audit: error: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except Exception as e:
        trace = settings.output_dir / "error.txt"
        try:
            trace.parent.mkdir(parents=True, exist_ok=True)
            trace.write_text(traceback.format_exc())
            where = f"; the full trace is in {trace}"
        except OSError:
            where = ""
        print(f"delay-sidecar audit: error: the audit could not run: {_reason(e)}{where}", file=sys.stderr)
        return EXIT_CANNOT_RUN


def main(argv: list[str] | None = None) -> None:
    """Entry point of `spark-submit spark/audit_job.py ...` (same flags as `delay-sidecar audit`)."""

    try:
        settings = CliApp.run(AuditSettings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        print(f"delay-sidecar audit: error: {e}", file=sys.stderr)
        sys.exit(EXIT_CANNOT_RUN)
    sys.exit(run_job(settings))


if __name__ == "__main__":
    main()
