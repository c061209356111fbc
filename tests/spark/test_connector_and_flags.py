"""Which Kafka source the audit takes, and the Spark flags, without starting another JVM.

The connector is looked up in a JVM class loader; a fake connector jar in a class loader of its own
stands in for `--jars` or `--packages` (the real connector cannot be downloaded here). The
end-to-end runs with a fresh JVM are in test_audit_cli.py.
"""

import logging
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from sidecar.errors import ConfigError
from spark.audit_job import session_for, shuffle_partitions_for, spark_conf
from spark.kafka_source import SOURCE_NAME
from spark.session import (
    Connector,
    connector_in_jar,
    connector_problem,
    find_connectors,
    resolve_source,
    spark_versions,
)
from spark.settings import AuditSettings
from tests.spark.fake_connector import fake_connector


def loader_for(spark: SparkSession, *jars: Path) -> Any:
    """A JVM class loader that sees only `jars` (no parent: Spark's own jars stay out of it)."""
    gateway = spark.sparkContext._gateway
    jvm = spark.sparkContext._jvm
    assert gateway is not None and jvm is not None
    urls = gateway.new_array(jvm.java.net.URL, len(jars))
    for i, jar in enumerate(jars):
        urls[i] = jvm.java.io.File(str(jar)).toURI().toURL()
    return jvm.java.net.URLClassLoader(urls, None)


def test_version_comes_from_pom_properties_then_manifest_then_file_name(tmp_path: Path) -> None:
    full = fake_connector(tmp_path, "4.0.0", name="renamed.jar")
    assert connector_in_jar(full) == Connector(str(full), "4.0.0", "2.13")
    (tmp_path / "m").mkdir()
    manifest_only = fake_connector(tmp_path / "m", "3.5.1", scala="2.12", pom=False, name="kafka.jar")
    assert connector_in_jar(manifest_only).version == "3.5.1"
    (tmp_path / "n").mkdir()
    name_only = fake_connector(tmp_path / "n", "4.1.0", pom=False, manifest=False)
    assert connector_in_jar(name_only) == Connector(str(name_only), "4.1.0", "2.13")


def test_spark_version_is_read_from_the_running_jvm(spark: SparkSession) -> None:
    import pyspark  # noqa: PLC0415

    version, scala = spark_versions(spark)
    assert version == pyspark.__version__
    assert scala == "2.13"


def test_a_connector_of_another_spark_version_is_found_on_a_classpath_and_named_in_the_error(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    jar = fake_connector(tmp_path, "4.0.0")
    loader = loader_for(spark, jar)
    assert find_connectors(spark, loader) == [Connector(str(jar), "4.0.0", "2.13")]
    version, _ = spark_versions(spark)
    with pytest.raises(ConfigError) as refused:
        resolve_source(spark, "kafka", loader)
    message = str(refused.value)
    assert "4.0.0" in message and f"Spark {version}" in message and str(jar) in message
    assert f"--packages org.apache.spark:spark-sql-kafka-0-10_2.13:{version}" in message
    # auto: the Python source, with a warning that says why.
    with caplog.at_level(logging.WARNING, logger="spark.session"):
        decision = resolve_source(spark, "auto", loader)
    assert decision.format == SOURCE_NAME
    assert decision.connectors == (Connector(str(jar), "4.0.0", "2.13"),)
    assert decision.fallback_reason is not None and "4.0.0" in decision.fallback_reason
    assert any("kafka connector unusable" in r.getMessage() for r in caplog.records)


def test_no_connector_means_python_for_auto_and_an_error_with_the_coordinate_for_kafka(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    empty = loader_for(spark)
    version, _ = spark_versions(spark)
    with caplog.at_level(logging.WARNING, logger="spark.session"):
        assert resolve_source(spark, "auto", empty).format == SOURCE_NAME
    assert not caplog.records  # nothing to warn about: the Python source is the way without a connector
    with pytest.raises(ConfigError, match=f"spark-sql-kafka-0-10_2.13:{version}"):
        resolve_source(spark, "kafka", empty)


def test_a_scala_mismatch_is_a_version_mismatch_too() -> None:
    problem = connector_problem([Connector("k.jar", "4.3.0", "2.12")], "4.3.0", "2.13")
    assert problem is not None and "Scala 2.12" in problem and "spark-sql-kafka-0-10_2.13:4.3.0" in problem
    assert connector_problem([Connector("k.jar", "4.3.0", "2.13")], "4.3.0", "2.13") is None


def test_conf_flags_are_key_value_pairs_with_commas_kept_in_values() -> None:
    # The command line splits list flags on commas: the pieces are put back together.
    entries = ["spark.jars=a.jar", "b.jar", "spark.driver.extraJavaOptions=-Da=1", "-Db=2", "spark.x=1"]
    assert spark_conf(entries) == {
        "spark.jars": "a.jar,b.jar",
        "spark.driver.extraJavaOptions": "-Da=1,-Db=2",
        "spark.x": "1",
    }
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        spark_conf(["spark.executor.memory"])


def test_shuffle_partitions_follow_the_input_size() -> None:
    assert shuffle_partitions_for(19_000, cores=2) == 2  # not Spark's 200
    assert shuffle_partitions_for(3_000_000, cores=2) == 6
    assert shuffle_partitions_for(1_000_000_000, cores=64) == 2000
    assert shuffle_partitions_for(0, cores=1) == 1


def test_under_spark_submit_the_flags_that_start_spark_are_refused_with_where_they_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # what spark-submit sets for the driver
    settings = AuditSettings(bootstrap_servers="localhost:1", packages="g:a:1", master="yarn")
    with pytest.raises(ConfigError, match=r"--master, --packages after spark/audit_job\.py come too late"):
        session_for(settings)
