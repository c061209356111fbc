"""The SparkSession of the audit, and which Kafka source it reads with.

`--source kafka` is Spark's built-in source (the spark-sql-kafka-0-10 connector, from `--packages`);
`--source python` is spark.kafka_source (confluent-kafka, no connector); `auto` takes the built-in
one when the connector is on the classpath. The audit logic never knows which.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pyspark.sql import SparkSession

from sidecar.errors import ConfigError
from spark.kafka_source import SOURCE_NAME, KafkaPythonSource

SourceChoice = Literal["kafka", "python", "auto"]
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def build_session(
    master: str | None = "local[*]",
    app_name: str = "delay-sidecar-audit",
    driver_memory: str | None = None,
    shuffle_partitions: int | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A session with the Python Kafka source registered; `master` None keeps spark-submit's choice."""
    # Python workers must run the interpreter that has pyarrow, pandas and confluent-kafka.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Local workers import spark.kafka_source by name: make the project importable there.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(PROJECT_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *paths])
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    if driver_memory:
        builder = builder.config("spark.driver.memory", driver_memory)
    if shuffle_partitions:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    builder = builder.config("spark.sql.session.timeZone", "UTC").config("spark.ui.showConsoleProgress", "false")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.dataSource.register(KafkaPythonSource)
    return spark


def builtin_kafka_available(spark: SparkSession) -> bool:
    """True when Spark's own `kafka` format resolves (the connector is on the classpath).

    Loading a batch Kafka relation only validates options; it does not contact a broker.
    """
    try:
        spark.read.format("kafka").option("kafka.bootstrap.servers", "localhost:1").option("subscribe", "probe").load()
    except Exception as e:
        text = str(e)
        if any(
            marker in text
            for marker in ("KAFKA_DATA_SOURCE_NOT_ENABLED", "DATA_SOURCE_NOT_FOUND", "Failed to find data source")
        ):
            return False
        raise
    return True


def resolve_source(spark: SparkSession, choice: SourceChoice) -> str:
    """The format name to read Kafka with: "kafka" (built-in) or the Python source's name."""
    if choice == "python":
        return SOURCE_NAME
    available = builtin_kafka_available(spark)
    if choice == "kafka" and not available:
        raise ConfigError(
            "Spark's built-in Kafka source is not on the classpath: run with "
            "--packages org.apache.spark:spark-sql-kafka-0-10_2.13:<your Spark version>, or use --source python"
        )
    return "kafka" if available else SOURCE_NAME
