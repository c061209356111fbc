"""Which Kafka source the audit takes, how the connector is fetched and cached, and the Spark flags,
without starting another JVM.

The shared session has the real connector (fetched once into the cache, tests/spark/conftest.py).
Other classpaths are JVM class loaders of their own: a fake connector jar in one stands in for
`--jars` or `--packages` of another version. The end-to-end runs with a fresh JVM, where the
connector is fetched or not, are in test_audit_cli.py.
"""

import logging
from pathlib import Path
from typing import Any

import pyspark
import pytest
from pyspark.sql import SparkSession

from sidecar.errors import ConfigError
from spark import connector as connector_module
from spark.audit_job import session_for, shuffle_partitions_for, spark_conf
from spark.connector import STAMP, ConnectorUnavailable, connector_dir, connector_jars, installed_spark
from spark.kafka_source import SOURCE_NAME
from spark.session import (
    UNAVAILABLE_CONF,
    Connector,
    connector_in_jar,
    connector_problem,
    find_connectors,
    resolve_source,
    spark_versions,
    with_connector,
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


def test_the_audits_session_waits_an_hour_for_a_broadcast_not_300_s(spark: SparkSession) -> None:
    """A loaded machine took more than Spark's default 300 s to build a broadcast's small side, and
    the audit failed instead of being slow (spark/session.py)."""
    assert spark.conf.get("spark.sql.broadcastTimeout") == "3600"


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
    assert (
        decision.label
        == f"python (fallback: connector of another Spark on the classpath (4.0.0; this is Spark {version}))"
    )
    assert [r.getMessage() for r in caplog.records if "kafka connector unusable" in r.getMessage()] != []


def test_no_connector_means_python_with_a_warning_for_auto_and_an_error_with_the_coordinate_for_kafka(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    empty = loader_for(spark)
    version, _ = spark_versions(spark)
    with caplog.at_level(logging.WARNING, logger="spark.session"):
        decision = resolve_source(spark, "auto", empty)
    assert (decision.format, decision.label) == (SOURCE_NAME, "python (fallback: connector not on the classpath)")
    [warning] = caplog.records  # the connector is the default: reading without it is worth one line
    assert f"--packages org.apache.spark:spark-sql-kafka-0-10_2.13:{version}" in warning.getMessage()
    with pytest.raises(ConfigError, match=f"spark-sql-kafka-0-10_2.13:{version}"):
        resolve_source(spark, "kafka", empty)


def test_a_scala_mismatch_is_a_version_mismatch_too() -> None:
    problem = connector_problem([Connector("k.jar", "4.3.0", "2.12")], "4.3.0", "2.13")
    assert problem is not None and "Scala 2.12" in problem.message
    assert "spark-sql-kafka-0-10_2.13:4.3.0" in problem.message
    assert connector_problem([Connector("k.jar", "4.3.0", "2.13")], "4.3.0", "2.13") is None


def test_the_shared_session_reads_with_the_fetched_connector_of_this_spark(spark: SparkSession) -> None:
    build = installed_spark()
    assert (build.version, build.scala) == spark_versions(spark) == (pyspark.__version__, "2.13")
    decision = resolve_source(spark, "auto")
    assert (decision.format, decision.label) == ("kafka", f"spark-sql-kafka-0-10 {pyspark.__version__}")
    [found] = decision.connectors
    assert Path(found.location).parent == connector_dir(build) and found.version == pyspark.__version__
    # Only what Spark lacks: its own jars (hadoop-client-*, lz4, snappy...) are not loaded twice.
    names = sorted(p.name.rsplit("-", 1)[0] for p in connector_dir(build).glob("*.jar"))
    assert names == [
        "commons-pool2",
        "kafka-clients",
        "spark-sql-kafka-0-10_2.13",
        "spark-token-provider-kafka-0-10_2.13",
    ]


def test_an_unreachable_repository_leaves_no_cache_and_says_why_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELAY_SIDECAR_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConnectorUnavailable) as refused:
        connector_jars("http://127.0.0.1:1/maven2")  # nothing listens on port 1: connection refused
    folder = connector_dir(installed_spark())
    assert (
        refused.value.reason == "http://127.0.0.1:1/maven2/ unreachable (java.net.ConnectException: Connection refused)"
    )
    message = str(refused.value)
    for what_to_do in ("--connector-repository", f"{folder} and create the file {folder / STAMP}", "--source python"):
        assert what_to_do in message
    assert not folder.exists() and [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == []
    # The session builder keeps the reason in the session's conf instead of failing: `auto` falls back.
    conf = with_connector({"spark.x": "1"}, "http://127.0.0.1:1/maven2")
    assert conf == {"spark.x": "1", UNAVAILABLE_CONF: refused.value.reason}


def test_a_repository_without_the_connector_is_named_with_the_missing_coordinate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELAY_SIDECAR_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty-repo").mkdir()
    with pytest.raises(ConnectorUnavailable) as refused:
        connector_jars((tmp_path / "empty-repo").as_uri())
    coordinate = installed_spark().coordinate
    assert refused.value.reason == f"{coordinate} not found in {(tmp_path / 'empty-repo').as_uri()}/"


def test_a_cached_connector_is_used_without_a_fetch_and_added_to_the_given_jars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELAY_SIDECAR_CACHE_DIR", str(tmp_path))
    folder = connector_dir(installed_spark())
    folder.mkdir()
    jars = [folder / "kafka-clients-3.9.2.jar", folder / f"spark-sql-kafka-0-10_2.13-{pyspark.__version__}.jar"]
    for jar in jars:
        jar.write_bytes(b"")

    def no_fetch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cached connector is fetched again")

    monkeypatch.setattr(connector_module, "_fetch", no_fetch)
    # Without the stamp the folder is an interrupted fetch: not used.
    with pytest.raises(AssertionError, match="fetched again"):
        connector_jars()
    (folder / STAMP).write_text("done\n")
    assert connector_jars() == jars
    assert with_connector({"spark.jars": "mine.jar"}) == {"spark.jars": ",".join(["mine.jar", *map(str, jars)])}
    # A connector the operator gives is theirs: nothing is added (resolve_source checks its version).
    for given in (
        {"spark.jars": "/x/spark-sql-kafka-0-10_2.13-4.0.0.jar"},
        {"spark.jars.packages": "org.apache.spark:spark-sql-kafka-0-10_2.13:4.0.0"},
    ):
        assert with_connector(given) == given


def test_auto_falls_back_with_one_warning_that_says_why_the_connector_could_not_be_fetched(
    spark: SparkSession, caplog: pytest.LogCaptureFixture
) -> None:
    why = "http://127.0.0.1:1/maven2/ unreachable (java.net.ConnectException: Connection refused)"
    with caplog.at_level(logging.WARNING):
        decision = resolve_source(spark, "auto", loader_for(spark), unavailable=why)
    assert (decision.format, decision.label) == (SOURCE_NAME, f"python (fallback: connector not fetched: {why})")
    [warning] = caplog.records
    assert "kafka connector unusable, reading with the python source instead" in warning.getMessage()
    assert why in warning.getMessage() and "--connector-repository" in warning.getMessage()
    with pytest.raises(ConfigError, match="could not be fetched"):
        resolve_source(spark, "kafka", loader_for(spark), unavailable=why)


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
