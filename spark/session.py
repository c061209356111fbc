"""The SparkSession of the audit, and which Kafka source it reads with.

`--source kafka` is Spark's built-in source (the spark-sql-kafka-0-10 connector, which
build_session fetches once into a cache, spark.connector, and puts on the class path);
`--source python` is spark.kafka_source (confluent-kafka, no connector); `auto`, the default, takes
the built-in one and falls back to the Python source only when no connector of this Spark can be
fetched or found. The audit logic never knows which.

A connector built for another Spark version loads, then fails inside a task with errors such as
`NoClassDefFoundError: org/apache/spark/internal/LogKeys$TOPIC_PARTITIONS` (Spark's internals
change between releases). So the connector's version is read from its jar before anything runs
and compared with Spark's own.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from pyspark.sql import SparkSession

from sidecar.errors import ConfigError
from spark.connector import ARTIFACT, DEFAULT_REPOSITORY, ConnectorUnavailable, connector_jars
from spark.kafka_source import SOURCE_NAME, KafkaPythonSource

logger = logging.getLogger(__name__)

SourceChoice = Literal["kafka", "python", "auto"]
PROJECT_ROOT = Path(__file__).resolve().parent.parent

CONNECTOR_CLASS = "org/apache/spark/sql/kafka010/KafkaSourceProvider.class"
"""A resource every spark-sql-kafka-0-10 jar (or an assembly that shades it in) contains."""
CONNECTOR_ARTIFACT = re.compile(r"spark-sql-kafka-0-10_(?P<scala>\d+\.\d+)")
CONNECTOR_JAR_NAME = re.compile(r"spark-sql-kafka-0-10_(?P<scala>\d+\.\d+)-(?P<version>\d[\w.\-]*?)\.jar$")
UNAVAILABLE_CONF = "spark.delaySidecar.kafkaConnectorUnavailable"
"""Why build_session could not put the connector on the class path: kept in the session's own conf,
so whoever reads with the session later (the audit, a test sharing it) can say why."""


def build_session(
    master: str | None = "local[*]",
    app_name: str = "delay-sidecar-audit",
    driver_memory: str | None = None,
    shuffle_partitions: int | None = None,
    conf: Mapping[str, str] | None = None,
    kafka_connector: bool = True,
    connector_repository: str = DEFAULT_REPOSITORY,
) -> SparkSession:
    """A session with the Python Kafka source registered and, with `kafka_connector`, Spark's own.

    `master` None keeps spark-submit's choice. `conf` is applied last, so `--conf` wins over the
    audit's own defaults. spark.jars.packages and spark.jars (the connector's too) only take effect
    when this call starts the JVM: not under spark-submit, where they are spark-submit's own
    --packages and --jars, nor when this process has a session already (getOrCreate returns it).
    """
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
    # Spark gives up on a broadcast join whose small side is not built within 300 s: a loaded machine
    # made a suite's audit fail so (the keyed topics' block maxima, 2026-11-29). An audit that is
    # slow is still right; an hour is a limit for a broadcast that hangs, not for a slow one.
    builder = builder.config("spark.sql.broadcastTimeout", "3600")
    conf = dict(conf or {})
    if kafka_connector and not jvm_started():
        conf = with_connector(conf, connector_repository)
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.dataSource.register(KafkaPythonSource)
    return spark


def jvm_started() -> bool:
    """Whether a JVM runs already (spark-submit's, or this process's session): then jars come too late."""
    from pyspark import SparkContext  # noqa: PLC0415

    return "PYSPARK_GATEWAY_PORT" in os.environ or SparkContext._active_spark_context is not None


def with_connector(conf: dict[str, str], repository: str = DEFAULT_REPOSITORY) -> dict[str, str]:
    """`conf` with the cached (or freshly fetched) connector's jars added to spark.jars.

    Jars or packages that name a connector already are the operator's choice, and left alone
    (resolve_source checks their version). A connector that cannot be fetched leaves the reason in
    the conf (UNAVAILABLE_CONF): the session starts anyway, and `auto` reads with the Python source.
    """
    if ARTIFACT in conf.get("spark.jars", "") or ARTIFACT in conf.get("spark.jars.packages", ""):
        return conf
    try:
        jars = connector_jars(repository)
    except ConnectorUnavailable as e:
        return {**conf, UNAVAILABLE_CONF: " ".join(e.reason.split())}
    given = [j for j in conf.get("spark.jars", "").split(",") if j]
    return {**conf, "spark.jars": ",".join([*given, *(str(j) for j in jars)])}


@dataclass(frozen=True)
class Connector:
    """A spark-sql-kafka-0-10 jar found on the driver's classpath."""

    location: str
    version: str | None
    """Its Spark version (pom.properties, else the manifest's Implementation-Version, else the file name)."""
    scala: str | None
    """Its Scala binary version (2.13), from the artifact id."""


def connector_in_jar(path: Path) -> Connector:
    """What a connector jar says about itself: Maven's pom.properties, the manifest, or its file name."""
    version: str | None = None
    scala: str | None = None
    try:
        with zipfile.ZipFile(path) as jar:
            for name in jar.namelist():
                found = CONNECTOR_ARTIFACT.search(name)
                if name.startswith("META-INF/maven/org.apache.spark/") and name.endswith("/pom.properties") and found:
                    props = _properties(jar.read(name).decode("utf-8", "replace"))
                    version, scala = props.get("version"), found.group("scala")
                    break
            if version is None and "META-INF/MANIFEST.MF" in jar.namelist():
                manifest = _properties(jar.read("META-INF/MANIFEST.MF").decode("utf-8", "replace"), sep=":")
                version = manifest.get("Implementation-Version")
    except (OSError, zipfile.BadZipFile):
        pass
    named = CONNECTOR_JAR_NAME.search(path.name)
    if named:
        version = version or named.group("version")
        scala = scala or named.group("scala")
    return Connector(str(path), version, scala)


def _properties(text: str, sep: str = "=") -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, found, value = line.partition(sep)
        if found and not key.strip().startswith("#"):
            out[key.strip()] = value.strip()
    return out


def find_connectors(spark: SparkSession, loader: Any = None) -> list[Connector]:
    """Every jar on the driver's classpath that holds the Kafka connector (several: a conflict).

    `loader` is a JVM ClassLoader (default: the one Spark resolves data sources with).
    """
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    if loader is None:
        loader = jvm.org.apache.spark.util.Utils.getContextOrSparkClassLoader()
    urls = loader.getResources(CONNECTOR_CLASS)
    found: list[Connector] = []
    while urls.hasMoreElements():
        url = str(urls.nextElement().toString())
        # jar:file:/path/spark-sql-kafka-0-10_2.13-4.0.0.jar!/org/apache/...
        inner = url[len("jar:") :].split("!/", 1)[0] if url.startswith("jar:") else url
        parsed = urlparse(inner)
        if parsed.scheme == "file":
            found.append(connector_in_jar(Path(unquote(parsed.path))))
        else:
            found.append(Connector(inner, None, None))
    return found


def spark_versions(spark: SparkSession) -> tuple[str, str]:
    """(Spark version, Scala binary version) of the running JVM, e.g. ("4.3.0", "2.13")."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    scala = str(jvm.scala.util.Properties.versionNumberString())
    return spark.version, ".".join(scala.split(".")[:2])


def connector_coordinate(spark_version: str, scala: str) -> str:
    return f"org.apache.spark:spark-sql-kafka-0-10_{scala}:{spark_version}"


@dataclass(frozen=True)
class Problem:
    """Why the built-in source cannot read: `why` for the report's source line, `message` with what to do."""

    why: str
    message: str


def connector_problem(
    connectors: Sequence[Connector], spark_version: str, scala: str, unavailable: str | None = None
) -> Problem | None:
    """Why the connector(s) found cannot run on this Spark, or None when one matches exactly.

    `unavailable`: why the session was started without the connector it should have fetched.
    """
    coordinate = connector_coordinate(spark_version, scala)
    if not connectors:
        if unavailable:
            return Problem(
                f"connector not fetched: {unavailable}",
                f"Spark's Kafka connector {coordinate} could not be fetched ({unavailable}) and none is on the "
                "classpath: give a reachable Maven repository with --connector-repository URL, or run with "
                f"--packages {coordinate} (or --jars with that jar and kafka-clients), or use --source python",
            )
        return Problem(
            "connector not on the classpath",
            f"Spark's Kafka connector is not on the classpath: run with --packages {coordinate} "
            "(or --jars with that jar and kafka-clients), or use --source python",
        )
    wrong = [c for c in connectors if c.version != spark_version or (c.scala is not None and c.scala != scala)]
    if not wrong:
        return None
    shown = ", ".join(
        f"{c.location} (version {c.version or 'unknown'}{f', Scala {c.scala}' if c.scala else ''})" for c in wrong
    )
    return Problem(
        f"connector of another Spark on the classpath ({', '.join(c.version or 'unknown' for c in wrong)}; "
        f"this is Spark {spark_version})",
        f"Spark's Kafka connector on the classpath was built for another Spark: {shown}; this is Spark "
        f"{spark_version} with Scala {scala}, and a connector of another version fails inside the job "
        f"(e.g. NoClassDefFoundError). Remove that jar and run with --packages {coordinate}, or use --source python",
    )


def builtin_kafka_loads(spark: SparkSession) -> str | None:
    """None when Spark's own `kafka` format resolves and plans a read; else the error.

    Loading a batch Kafka relation only validates options; it does not contact a broker. It fails
    when the connector is there without its kafka-clients dependency (given with --jars alone).
    """
    try:
        spark.read.format("kafka").option("kafka.bootstrap.servers", "localhost:1").option("subscribe", "probe").load()
    except Exception as e:
        return str(e).splitlines()[0][:500]
    return None


@dataclass(frozen=True)
class SourceDecision:
    """Which Kafka source the audit reads with, and what was found on the way (for the report)."""

    format: str
    spark_version: str
    scala: str
    connectors: tuple[Connector, ...]
    fallback_reason: str | None = None
    """The whole message, with what to do; `fallback_why` is its short form."""
    fallback_why: str | None = None

    @property
    def label(self) -> str:
        """The source as the report and the summary name it."""
        if self.format == "kafka":
            return f"{ARTIFACT} {self.connectors[0].version or self.spark_version}"
        if self.fallback_why:
            return f"python (fallback: {self.fallback_why})"
        return "python (--source python)"


def connector_unavailable(spark: SparkSession) -> str | None:
    """Why the session was started without the connector it should have fetched (see with_connector)."""
    value = spark.sparkContext.getConf().get(UNAVAILABLE_CONF, None)
    return str(value) if value else None


def resolve_source(
    spark: SparkSession, choice: SourceChoice, loader: Any = None, unavailable: str | None = None
) -> SourceDecision:
    """The format to read Kafka with: "kafka" (built-in) or the Python source's name.

    `kafka` fails with the reason (a ConfigError, exit 2) when the connector is missing or of
    another version; `auto` then falls back to the Python source with one warning that says why.
    `loader`: where to look for the connector, as in find_connectors(); `unavailable`: why it could
    not be fetched (default: what the session's builder recorded).
    """
    spark_version, scala = spark_versions(spark)
    connectors = tuple(find_connectors(spark, loader))
    if choice == "python":
        return SourceDecision(SOURCE_NAME, spark_version, scala, connectors)
    if unavailable is None and loader is None:
        unavailable = connector_unavailable(spark)
    problem = connector_problem(connectors, spark_version, scala, unavailable)
    if problem is None:
        load_error = builtin_kafka_loads(spark)
        if load_error is not None:
            problem = Problem(
                f"connector does not load: {load_error}",
                f"Spark's Kafka connector {connectors[0].location} is on the classpath but does not load "
                f"({load_error}): run with --packages {connector_coordinate(spark_version, scala)}, "
                "which brings kafka-clients too, or use --source python",
            )
    if problem is None:
        return SourceDecision("kafka", spark_version, scala, connectors)
    if choice == "kafka":
        raise ConfigError(problem.message)
    logger.warning("kafka connector unusable, reading with the python source instead reason=%r", problem.message)
    return SourceDecision(
        SOURCE_NAME, spark_version, scala, connectors, fallback_reason=problem.message, fallback_why=problem.why
    )
