"""The settings of the audit job, as flags and DELAY_SIDECAR_* variables.

A module of its own, importing no Spark, so that the command (sidecar/cli.py mounts it), the job and
the report all depend on it and none of them on each other.
"""

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from sidecar.settings import ENV_PREFIX, KafkaSettings
from spark.connector import DEFAULT_REPOSITORY


class AuditSettings(KafkaSettings):
    """Audit every inbound record's fate: delivered to each subscription on time, exactly once, or dead-lettered."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, cli_kebab_case=True, extra="ignore")

    policies: Path | None = Field(
        None,
        description="Policy YAML file or directory: the inbound topics, their subscriptions' outbound topics, "
        "dead-letter topics and delay policies. Without it, give --topics and --subscriptions.",
    )
    topics: list[str] = Field(
        [], description="Inbound topics to audit (default with --policies: every topic of the policies)"
    )
    subscriptions: list[str] = Field(
        [], description="Without --policies: the subscriptions of every topic (outbound '{topic}.{subscription}')"
    )
    routes: list[str] = Field(
        [], description="Without --policies: outbound topics other than the default, as TOPIC/SUBSCRIPTION=OUTBOUND"
    )
    dead_letter_topics: list[str] = Field(
        [], description="Without --policies: dead-letter topics other than '{topic}.dlt', as TOPIC=DLT"
    )
    control_topic: str = Field(
        "delay-sidecar.control", description="Topic of nack, cancel and reschedule commands ('' to skip them)"
    )
    control_dead_letter_topic: str | None = Field(
        None, description="Dead-letter topic of commands (default: the control topic's name + '.dlt')"
    )
    outcomes_topic: str | None = Field(
        None,
        description="Topic of cancel and reschedule outcomes (default: the control topic's name + '.outcomes'; "
        "'' to skip them)",
    )
    starting_offsets: str = Field(
        "earliest",
        description='Inbound range start: earliest, or JSON per partition {"topic":{"0":23}} (-2 earliest)',
    )
    ending_offsets: str = Field(
        "latest", description='Inbound range end: latest, or JSON per partition {"topic":{"0":50}} (-1 latest)'
    )
    from_time: str | None = Field(
        None, description="Audit inbound records published at or after this time (epoch ms or RFC 3339)"
    )
    to_time: str | None = Field(None, description="Audit inbound records published before this time")
    grace_ms: int = Field(
        30_000, ge=0, description="How long after its deliver-at a record may still arrive before it is missing"
    )
    max_missing: int = Field(0, description="Most missing records (and nacks without redelivery) that still pass")
    max_duplicates: int = Field(
        0, description="Most duplicates (and dead-lettered or cancelled, yet delivered) that still pass"
    )
    max_early: int = Field(0, description="Most early deliveries (and before a reschedule's time) that still pass")
    max_late: int = Field(-1, description="Most deliveries later than deliver-at + grace that pass (-1: no limit)")
    max_out_of_order: int = Field(
        0,
        description="Most records of exclusive and failover subscriptions out of inbound order or off their "
        "inbound partition's number that still pass",
    )
    output_dir: Path = Field(
        Path("audit-report"),
        description="Where report.json, report.html, report.png, anomalies/ and rejections/ go",
    )
    source: Literal["auto", "kafka", "python"] = Field(
        "auto",
        description="Kafka reader. auto: Spark's built-in source, the spark-sql-kafka-0-10 connector of "
        "this Spark's version, fetched once from --connector-repository into the cache "
        "($DELAY_SIDECAR_CACHE_DIR, else ~/.cache/delay-sidecar) and reused; when it can be neither fetched "
        "nor found, the embedded Python source, with a warning and the reason in the report. kafka: the "
        "connector or exit 2. python: the embedded confluent-kafka data source, no connector",
    )
    connector_repository: str = Field(
        DEFAULT_REPOSITORY,
        description="Maven repository (URL) that Spark's Kafka connector is fetched from on first use, "
        "when not cached; a mirror where Maven Central is out of reach",
    )
    max_records_per_partition: int = Field(
        1_000_000,
        ge=1,
        description="Most records one Spark task reads: larger Kafka partitions are split into offset ranges "
        "(maxRecordsPerPartition), so a billion records need no task per Kafka partition",
    )
    isolation_level: Literal["read_committed", "read_uncommitted"] = Field(
        "read_committed",
        description="kafka.isolation.level of the reads: read_committed leaves out aborted transactions",
    )
    master: str | None = Field(None, description="Spark master, e.g. local[4] or yarn (default local[*])")
    packages: str | None = Field(
        None,
        description="Maven coordinates for Spark, comma-separated, as spark-submit --packages (a "
        "spark-sql-kafka-0-10 here replaces the cached connector)",
    )
    jars: str | None = Field(None, description="Jars for Spark's classpath, comma-separated, as spark-submit --jars")
    conf: list[str] = Field(
        [], description="Spark setting KEY=VALUE, as spark-submit --conf; repeat the flag for more than one"
    )
    driver_memory: str | None = Field(None, description="Spark driver memory, e.g. 4g (local mode: all memory)")
    shuffle_partitions: int | None = Field(
        None,
        ge=1,
        description="spark.sql.shuffle.partitions (default: sized to the input, one per 500k records, "
        "at least the cores)",
    )
    min_partitions: int | None = Field(
        None, ge=1, description="Split the Kafka read into at least this many Spark tasks (minPartitions)"
    )
    show_anomalies: int = Field(20, ge=0, description="How many anomalies to print (all are in the Parquet files)")

    @property
    def command_dead_letter_topic(self) -> str:
        """Where the sidecar puts refused commands: `<control topic>.dlt` unless named."""
        return self.control_dead_letter_topic or f"{self.control_topic}.dlt"

    @property
    def command_outcomes_topic(self) -> str:
        """Where cancels and reschedules are answered: `<control topic>.outcomes` unless named ('' skips)."""
        if self.outcomes_topic is not None:
            return self.outcomes_topic
        return f"{self.control_topic}.outcomes" if self.control_topic else ""
