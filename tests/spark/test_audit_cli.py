"""The audit as operators start it, each in a JVM of its own: `delay-sidecar audit` and `spark-submit`.

These are the only Spark tests that start more JVMs than the shared session (a few seconds each):
Spark's options (--jars, --conf, --master) and the connector's jars only take effect when the JVM
starts.
"""

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyspark
import pytest

from sidecar.outbound.records import outbound_headers
from spark.audit_job import EXIT_CANNOT_RUN, EXIT_OK
from spark.connector import connector_dir, installed_spark
from tests.kafka_helpers import KafkaHelper
from tests.spark.fake_connector import fake_connector

ROOT = Path(__file__).resolve().parents[2]
SPARK_HOME = Path(pyspark.__file__).parent


@pytest.fixture
def delivered_topic(
    kafka_helper: KafkaHelper, topic_factory: Callable[..., str], policy_file: Callable[[str], Path]
) -> Path:
    """Three inbound records, each delivered once and on time to subscription a; the policy file."""
    topic = topic_factory("cli")
    t0 = int(time.time() * 1000) - 600_000
    for offset in range(3):
        kafka_helper.produce(topic, b"v", headers=[("deliver-after", "1s")], timestamp=t0)
        headers = outbound_headers([("deliver-after", b"1s")], topic, 0, offset, t0 + 1000)
        kafka_helper.produce(f"{topic}.a", b"v", headers=headers, timestamp=t0 + 1005)
    kafka_helper.flush()
    return policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")


def run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def audit_args(kafka: str, policies: Path, out: Path) -> list[str]:
    return ["--bootstrap-servers", kafka, "--policies", str(policies), "--output-dir", str(out), "--control-topic", ""]


def test_spark_flags_reach_spark_and_auto_falls_back_from_a_connector_of_another_version(
    kafka: str, delivered_topic: Path, tmp_path: Path
) -> None:
    jar = fake_connector(tmp_path, "4.0.0")
    out = tmp_path / "report"
    flags = ["--master", "local[1]", "--jars", str(jar), "--conf", "spark.sql.shuffle.partitions=3"]
    flags += ["--conf", "spark.executor.extraJavaOptions=-Da=1,-Db=2", "--source", "auto"]
    done = run([sys.executable, "-m", "sidecar", "audit", *audit_args(kafka, delivered_topic, out), *flags])
    assert done.returncode == EXIT_OK, done.stderr[-3000:]
    assert "kafka connector unusable" in done.stderr and "4.0.0" in done.stderr
    report = json.loads((out / "report.json").read_text())
    spark = report["spark"]
    assert (spark["master"], spark["kafka_format"], spark["shuffle_partitions"]) == (
        "local[1]",
        "delay_sidecar_kafka",
        3,
    )
    assert str(jar) in spark["jars"]
    assert spark["conf"]["spark.executor.extraJavaOptions"] == "-Da=1,-Db=2"
    assert spark["kafka_connectors"] == [{"location": str(jar), "version": "4.0.0", "scala": "2.13"}]
    assert report["source"].startswith("python (fallback: connector of another Spark on the classpath (4.0.0")
    assert report["passed"] is True
    assert report["records_read"]["inbound"] == 3 and report["subscriptions"][0]["delivered"] == 3


def test_the_audit_reads_with_spark_s_connector_by_default_and_names_it(
    kafka: str, delivered_topic: Path, tmp_path: Path
) -> None:
    """The connector comes from the cache (fetched there on first use), with no flag."""
    out = tmp_path / "report"
    done = run(
        [sys.executable, "-m", "sidecar", "audit", *audit_args(kafka, delivered_topic, out), "--master", "local[1]"]
    )
    assert done.returncode == EXIT_OK, done.stderr[-3000:]
    assert "kafka connector unusable" not in done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["source"] == f"spark-sql-kafka-0-10 {pyspark.__version__}"
    assert f"Kafka source: spark-sql-kafka-0-10 {pyspark.__version__}\n" in done.stdout
    folder = connector_dir(installed_spark())
    assert [c["location"] for c in report["spark"]["kafka_connectors"]] == [
        str(folder / f"spark-sql-kafka-0-10_2.13-{pyspark.__version__}.jar")
    ]
    assert report["records_read"]["inbound"] == 3 and report["subscriptions"][0]["delivered"] == 3


def test_a_connector_that_cannot_be_fetched_falls_back_to_python_with_one_warning_and_the_report_says_why(
    kafka: str, delivered_topic: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    env = {**os.environ, "DELAY_SIDECAR_CACHE_DIR": str(tmp_path / "empty-cache")}
    unreachable = ["--connector-repository", "http://127.0.0.1:1/maven2/"]  # nothing listens on port 1
    command = [sys.executable, "-m", "sidecar", "audit", *audit_args(kafka, delivered_topic, out), *unreachable]
    done = run([*command, "--master", "local[1]"], env=env)
    assert done.returncode == EXIT_OK, done.stderr[-3000:]
    why = (
        "connector not fetched: http://127.0.0.1:1/maven2/ unreachable (java.net.ConnectException: Connection refused)"
    )
    [warning] = [line for line in done.stderr.splitlines() if "connector" in line and "level=WARNING" in line]
    assert (
        "kafka connector unusable, reading with the python source instead" in warning
        and "--connector-repository" in warning
    )
    report = json.loads((out / "report.json").read_text())
    assert report["source"] == f"python (fallback: {why})"
    assert f"Kafka source: python (fallback: {why})\n" in done.stdout
    assert report["spark"]["kafka_connectors"] == [] and "--connector-repository" in report["spark"]["fallback_reason"]
    assert report["records_read"]["inbound"] == 3 and report["subscriptions"][0]["delivered"] == 3


def test_spark_submit_without_the_venv_on_path_names_both_versions_and_exits_2(
    kafka: str, delivered_topic: Path, tmp_path: Path
) -> None:
    """A cluster's spark-submit starts the driver with the system python3, which lacks the audit's
    packages: the job re-runs itself with the project's venv, then refuses the 4.0.0 connector."""
    jar = fake_connector(tmp_path, "4.0.0")
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin", "SPARK_HOME": str(SPARK_HOME)}
    submit = [str(SPARK_HOME / "bin" / "spark-submit"), "--master", "local[1]", "--jars", str(jar)]
    script = [str(ROOT / "spark" / "audit_job.py"), *audit_args(kafka, delivered_topic, tmp_path / "r")]
    done = run([*submit, *script, "--source", "kafka"], env=env)
    assert done.returncode == EXIT_CANNOT_RUN, done.stderr[-3000:]
    # spark-submit's PythonRunner merges the driver's stderr into its stdout.
    printed = (done.stdout + done.stderr).splitlines()
    [error] = [line for line in printed if line.startswith("delay-sidecar audit: error:")]
    assert "version 4.0.0" in error and f"Spark {pyspark.__version__}" in error
    assert f"--packages org.apache.spark:spark-sql-kafka-0-10_2.13:{pyspark.__version__}" in error


def test_a_crash_of_spark_itself_exits_2_with_the_reason_on_stderr(
    kafka: str, delivered_topic: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    args = [*audit_args(kafka, delivered_topic, out), "--master", "no-such-master://x"]
    done = run([sys.executable, "-m", "sidecar", "audit", *args])
    assert done.returncode == EXIT_CANNOT_RUN
    [error] = [line for line in done.stderr.splitlines() if line.startswith("delay-sidecar audit: error:")]
    assert "the audit could not run" in error and "JAVA_GATEWAY_EXITED" in error
    assert "Master must either be yarn or start with" in done.stderr  # Spark's own reason, above ours
    assert "Traceback" in (out / "error.txt").read_text()
