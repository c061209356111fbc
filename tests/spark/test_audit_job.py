"""The audit job end to end against a real broker: on the real sidecar's topics, and on injected faults.

The shared session has Spark's Kafka connector (tests/spark/conftest.py), so an audit of the
default `--source auto` reads with it; the Python source reads where a test says `source="python"`.
"""

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pyspark
import pytest
from confluent_kafka import Producer
from pydantic_settings import CliApp
from pyspark.sql import SparkSession

from sidecar.client import Nacker
from sidecar.outbound.records import OutHeaders, dead_letter_headers, outbound_headers
from spark.audit_job import EXIT_ANOMALIES, EXIT_OK, EXIT_USAGE, audit, run_job
from spark.command import AuditCommand
from spark.settings import AuditSettings
from tests.control.test_nack_flow import RecordView
from tests.kafka_helpers import KafkaHelper, PolicyFile, ThreadedSidecar, TopicFactory, settings_for


def persisted_rdds(spark: SparkSession) -> set[int]:
    """The ids of the RDDs the session's context holds persisted (cached DataFrames among them)."""
    return {int(rdd_id) for rdd_id in spark.sparkContext._jsc.getPersistentRDDs().keySet()}  # type: ignore[union-attr]


def parquet_rows(path: Path) -> list[dict[str, Any]]:
    return sorted(pq.read_table(path).to_pylist(), key=lambda r: (r.get("kind", ""), r["offset"]))


def test_real_sidecar_topics_audit_clean_with_correct_counts(
    spark: SparkSession,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
) -> None:
    topic = topic_factory("audit", partitions=2)
    policies = policy_file(f"""
topics:
  {topic}:
    delayed_delivery: {{max_delivery_delay: 1m}}
    control_topic: {topic}.control
    subscriptions:
      billing: {{}}
      shipping: {{}}
      archive: {{type: exclusive}}
""")
    control = f"ctl-{uuid.uuid4().hex[:8]}"
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path / "state", control_topic=control)):
        for i in range(6):
            kafka_helper.produce(topic, f"d{i}".encode(), headers=[("deliver-after", f"{1000 + 100 * i}ms")])
        deliver_at = int(time.time() * 1000) + 1500
        kafka_helper.produce(topic, b"at", headers=[("deliver-at", str(deliver_at))], partition=0)
        for i in range(3):
            kafka_helper.produce(topic, f"now{i}".encode(), partition=1)
        kafka_helper.produce(topic, b"bad", headers=[("deliver-after", "tomorrow")], partition=0)
        kafka_helper.produce(topic, b"too-far", headers=[("deliver-after", "90s")], partition=1)
        kafka_helper.flush()
        for sub in ("billing", "shipping", "archive"):
            assert len(kafka_helper.read(f"{topic}.{sub}", 10, timeout_s=30)) == 10
        assert len(kafka_helper.read(f"{topic}.dlt", 2, timeout_s=30)) == 2
        # A consumer of billing nacks one record on the topic's own control topic; it comes back once,
        # with redelivery count 1. The same nack on the default control topic is refused.
        billing = kafka_helper.read(f"{topic}.billing", 10)
        producer = Producer({"bootstrap.servers": kafka})
        Nacker(producer, control_topic=control, subscription="billing").nack(RecordView(billing[1]), 500)  # type: ignore[arg-type]
        nacker = Nacker(producer, control_topic=f"{topic}.control", subscription="billing")
        nacker.nack(RecordView(billing[0]), 500)  # type: ignore[arg-type]
        nacker.flush()
        assert len(kafka_helper.read(f"{topic}.billing", 11, timeout_s=30)) == 11
        assert len(kafka_helper.read(f"{control}.dlt", 1, timeout_s=30)) == 1

    settings = AuditSettings(
        bootstrap_servers=kafka,
        policies=policies,
        output_dir=tmp_path / "report",
        grace_ms=5000,
        source="python",
        control_topic=control,
    )
    before = persisted_rdds(spark)
    outcome = audit(settings, spark)
    assert outcome.exit_code == EXIT_OK
    # What the audit cached is released: a session that audits again and again (the chaos module's)
    # otherwise fills its heap with every audit's cached frames.
    assert persisted_rdds(spark) == before
    assert outcome.result.anomaly_counts == dict.fromkeys(outcome.result.anomaly_counts, 0)
    by_sub = {s.subscription: s for s in outcome.result.subscriptions}
    assert set(by_sub) == {"billing", "shipping", "archive"}
    for s in by_sub.values():
        assert (s.inbound, s.rejected, s.accepted, s.delivered, s.pending, s.missing) == (12, 2, 10, 10, 0, 0)
        assert (s.duplicates, s.early) == (0, 0)
        assert s.lateness_max_ms is not None and s.lateness_max_ms >= 0  # how late: a timing, for bench/
    assert (by_sub["billing"].nacks, by_sub["billing"].redelivered, by_sub["billing"].nacks_missing) == (1, 1, 0)
    assert (by_sub["shipping"].nacks, by_sub["shipping"].redelivered) == (0, 0)
    assert outcome.result.rejections == [
        {"topic": topic, "code": "EXCEEDS_MAX_DELAY", "count": 1},
        {"topic": topic, "code": "INVALID_DELAY_HEADER", "count": 1},
    ]
    assert outcome.result.control_rejections == [{"code": "WRONG_CONTROL_TOPIC", "count": 1}]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["passed"] is True and report["source"] == "python (--source python)"
    ranges = report["snapshot"]["inbound"][topic]
    assert set(ranges) == {"0", "1"} and all(start == 0 for start, _ in ranges.values())
    assert sum(end for _, end in ranges.values()) == 12  # the partitioner decides the split
    assert (tmp_path / "report" / "report.png").stat().st_size > 1000
    assert parquet_rows(tmp_path / "report" / "anomalies") == []
    assert {(r["code"], r["topic"]) for r in parquet_rows(tmp_path / "report" / "rejections")} == {
        ("INVALID_DELAY_HEADER", topic),
        ("EXCEEDS_MAX_DELAY", topic),
    }


CONNECTOR = f"spark-sql-kafka-0-10 {pyspark.__version__}"
"""The source an audit names when it read with the shared session's connector."""


class Delivered:
    """An outbound record as a Nacker reads it (its headers only)."""

    def __init__(self, headers: OutHeaders) -> None:
        self._headers = headers

    def headers(self) -> OutHeaders:
        return self._headers


def faults_world(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, control: str
) -> tuple[str, Path]:
    """Records with a known fate (fine, duplicated, early, missing, rejected, aborted, nacked and never
    redelivered) on a topic of their own; the topic and its policy file."""
    topic = topic_factory("faults", partitions=2)
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}, b: {{}}}}\n")
    t0 = int(time.time() * 1000) - 600_000
    # Inbound: p0 offsets 0 (fine), 1 (duplicated on a), 2 (early on a); p1 offsets 0 (missing on b), 1 (rejected).
    for partition, count in ((0, 3), (1, 2)):
        for _ in range(count):
            kafka_helper.produce(topic, b"v", headers=[("deliver-after", "1s")], partition=partition, timestamp=t0)
    kafka_helper.flush()

    def deliver(sub: str, partition: int, offset: int, at_ms: int, deliver_at: int = t0 + 1000) -> None:
        headers = outbound_headers([("deliver-after", b"1s")], topic, partition, offset, deliver_at)
        kafka_helper.produce(f"{topic}.{sub}", b"v", headers=headers, timestamp=at_ms)

    for sub in ("a", "b"):
        deliver(sub, 0, 0, t0 + 1010)
        deliver(sub, 0, 1, t0 + 1020)
        deliver(sub, 0, 2, t0 + 1030)
    deliver("a", 0, 1, t0 + 1040)  # duplicate
    deliver("a", 0, 2, t0 + 400)  # early (and, as a second copy of 0/2 on a, a duplicate too)
    deliver("a", 1, 0, t0 + 1050)  # 1/0 reaches a only: missing on b
    dlt_headers = dead_letter_headers([], topic, 1, 1, "INVALID_DELAY_HEADER", "not a duration")
    kafka_helper.produce(f"{topic}.dlt", b"v", headers=dlt_headers, timestamp=t0)
    kafka_helper.flush()
    # A sidecar's aborted transaction wrote a second copy of 0/0 on b: never delivered, not a duplicate.
    aborted = Producer({"bootstrap.servers": kafka, "transactional.id": f"audit-{uuid.uuid4().hex[:8]}"})
    aborted.init_transactions(30)
    aborted.begin_transaction()
    headers = outbound_headers([("deliver-after", b"1s")], topic, 0, 0, t0 + 1000)
    aborted.produce(f"{topic}.b", b"v", headers=headers, timestamp=t0 + 1060)
    aborted.flush()
    aborted.abort_transaction(30)
    if control:  # a consumer of b nacks 0/0, and it never comes back: a nack without redelivery
        nacker = Nacker(Producer({"bootstrap.servers": kafka}), control_topic=control, subscription="b")
        # Due long ago (not "now + delay"), so it is missing, not pending, whenever the audit runs.
        nacker.nack_at(Delivered(outbound_headers([], topic, 0, 0, t0 + 1000)), t0 + 2000)
        nacker.flush()
    return topic, policies


def test_injected_faults_are_reported_with_their_origin_and_fail_the_audit(
    spark: SparkSession,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Also the audit of the default source, Spark's own connector, end to end on the broker."""
    topic, policies = faults_world(kafka, kafka_helper, topic_factory, policy_file, control="")
    out = tmp_path / "report"
    args = ["--bootstrap-servers", kafka, "--policies", str(policies), "--output-dir", str(out), "--grace-ms", "5000"]
    with pytest.raises(SystemExit) as exited:
        CliApp.run(AuditCommand, cli_args=args)
    assert exited.value.code == EXIT_ANOMALIES
    anomalies = [
        (r["kind"], r["topic"], r["partition"], r["offset"], r["subscription"], r["outbound_topic"])
        for r in parquet_rows(out / "anomalies")
    ]
    assert sorted(anomalies) == [
        ("duplicate", topic, 0, 1, "a", f"{topic}.a"),
        ("duplicate", topic, 0, 2, "a", f"{topic}.a"),
        ("early", topic, 0, 2, "a", f"{topic}.a"),
        ("missing", topic, 1, 0, "b", None),
    ]
    [rejected] = parquet_rows(out / "rejections")
    assert (rejected["topic"], rejected["partition"], rejected["offset"], rejected["code"]) == (
        topic,
        1,
        1,
        "INVALID_DELAY_HEADER",
    )
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False
    assert report["source"] == CONNECTOR and report["spark"]["kafka_format"] == "kafka"
    assert report["spark"]["isolation_level"] == "read_committed"
    read = report["records_read"]
    assert (read["inbound"], read["outbound"], read["dead_letter"]) == (5, 9, 1)  # the aborted copy is not read
    # The wall time covers writing the anomalies (the write phase), not just judging.
    phases = report["timings_s"]
    assert set(phases) == {"snapshot", "spark_start", "read", "analysis", "write"}
    assert report["wall_time_s"] >= sum(phases.values())
    assert (out / "report.html").read_text().count("<tr>") >= 1 + 4  # the summary and the anomalies
    assert report["thresholds"]["missing"] == {"limit": 0, "actual": 1, "exceeded": True}
    assert report["thresholds"]["duplicates"]["actual"] == 2 and report["thresholds"]["early"]["actual"] == 1
    printed = capsys.readouterr().out
    assert "FAIL: missing 1 (max 0, EXCEEDED)" in printed and "INVALID_DELAY_HEADER" in printed
    assert f"Kafka source: {CONNECTOR}\n" in printed
    # The same audit passes when the thresholds allow what was found.
    lenient = AuditSettings(
        bootstrap_servers=kafka,
        policies=policies,
        output_dir=tmp_path / "lenient",
        grace_ms=5000,
        max_missing=1,
        max_duplicates=2,
        max_early=1,
    )
    assert run_job(lenient, spark) == EXIT_OK


def test_both_sources_agree_on_every_count_of_the_same_topics(
    spark: SparkSession,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
) -> None:
    """Spark's connector and the Python source read the same records, aborted ones left out alike."""
    control = f"ctl-{uuid.uuid4().hex[:8]}"
    topic, policies = faults_world(kafka, kafka_helper, topic_factory, policy_file, control=control)
    reports: dict[str, dict[str, Any]] = {}
    anomalies: dict[str, list[dict[str, Any]]] = {}
    for source in ("kafka", "python"):
        settings = AuditSettings(
            bootstrap_servers=kafka,
            policies=policies,
            output_dir=tmp_path / source,
            grace_ms=5000,
            source=source,
            control_topic=control,
            show_anomalies=0,
        )
        reports[source] = audit(settings, spark).report
        anomalies[source] = parquet_rows(tmp_path / source / "anomalies")
    assert reports["kafka"]["source"] == CONNECTOR
    assert reports["python"]["source"] == "python (--source python)"
    assert {s["topic"] for s in reports["kafka"]["subscriptions"]} == {topic}
    by_sub = {s["subscription"]: s for s in reports["kafka"]["subscriptions"]}
    assert (by_sub["b"]["nacks"], by_sub["b"]["nacks_missing"], by_sub["a"]["duplicates"]) == (1, 1, 2)
    assert reports["kafka"]["records_read"]["outbound"] == 9  # the aborted copy is read by neither
    for report in reports.values():
        for key in ("source", "spark", "outputs", "timings_s", "wall_time_s"):
            report.pop(key)
        report["snapshot"].pop("as_of_ms")
    assert reports["kafka"] == reports["python"]
    assert anomalies["kafka"] == anomalies["python"] and len(anomalies["kafka"]) == 5


def test_usage_errors_exit_2_without_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_job(AuditSettings(policies=tmp_path / "none.yaml")) == EXIT_USAGE
    assert "--bootstrap-servers" in capsys.readouterr().err
    assert run_job(AuditSettings(bootstrap_servers="localhost:1", topics=["a"])) == EXIT_USAGE
    assert "--subscriptions" in capsys.readouterr().err
