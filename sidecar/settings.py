"""Settings: every one is a CLI flag and a DELAY_SIDECAR_* environment variable (contract section 6).

Flags win over environment variables, which win over the defaults here. Kafka security settings
pass through to librdkafka; secrets are SecretStr, so they never appear in logs or reprs.
"""

import hashlib
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, CliImplicitFlag, SettingsConfigDict

from sidecar.broker.local import KIND_HELP, BrokerKind

ENV_PREFIX = "DELAY_SIDECAR_"

SESSION_TIMEOUT_MS = 45_000
"""The consumer's session.timeout.ms: Kafka's own default since 3.0 (KIP-735), and not 15 s, because a
live sidecar must keep its session through the death of any one broker of three. Kafka 4's group
coordinator answers a heartbeat only once the group's last offset commit is replicated (a heartbeat
is a write in its coordinator runtime), and that waits for the dead broker to leave the offsets
partition's ISR: up to broker.session.timeout.ms (9 s), then up to offsets.commit.timeout.ms (5 s)
for the heartbeats queued behind it, after up to heartbeat.interval.ms (3 s) since the last answer.
With 15 s the session of a live member lapsed in a loaded CI run, librdkafka made the rejoin's
FENCED_INSTANCE_ID fatal, and the engine started again from its last checkpoint."""


REBOOTSTRAP_AFTER_MS = 10_000
"""librdkafka's metadata.recovery.rebootstrap.trigger.ms: how long a client that reaches no broker
goes on before it starts again from bootstrap.servers (librdkafka's default is 5 minutes). A single
node in a controlled shutdown leaves itself out of the metadata it still serves, and librdkafka
2.16 then forgets the broker it had learned and tries the bootstrap servers, down at that moment.
In 2 of 15 runs of the broker-outage test beside busy neighbours (2026-12-01), the producer (its
statistics naming no broker) or the consumer (`no broker available for coordinator query`) did not
reach the restarted broker in the two minutes the test waited; with this setting, 0 of 15, though
none of those showed the stuck state. It did not bring back the engine's admin client in a later
CI run, which is made again instead (broker/admin.py: FRESH_CLIENT_AFTER_S)."""


class KafkaSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, cli_kebab_case=True, extra="ignore")

    bootstrap_servers: str | None = Field(None, description="Kafka bootstrap servers")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] | None = Field(
        None, description="librdkafka security.protocol"
    )
    sasl_mechanism: str | None = Field(None, description="librdkafka sasl.mechanism (PLAIN, SCRAM-SHA-512, ...)")
    sasl_username: str | None = Field(None, description="librdkafka sasl.username")
    sasl_password: SecretStr | None = Field(None, description="librdkafka sasl.password (never logged)")
    ssl_ca_location: str | None = Field(None, description="librdkafka ssl.ca.location")
    ssl_key_password: SecretStr | None = Field(None, description="librdkafka ssl.key.password (never logged)")

    def client_config(self, bootstrap_servers: str) -> dict[str, Any]:
        """The librdkafka settings shared by every client; the only place secrets are revealed."""
        config: dict[str, Any] = {
            "bootstrap.servers": bootstrap_servers,
            "metadata.recovery.rebootstrap.trigger.ms": REBOOTSTRAP_AFTER_MS,
        }
        for key, value in (
            ("security.protocol", self.security_protocol),
            ("sasl.mechanism", self.sasl_mechanism),
            ("sasl.username", self.sasl_username),
            ("ssl.ca.location", self.ssl_ca_location),
        ):
            if value is not None:
                config[key] = value
        for key, secret in (
            ("sasl.password", self.sasl_password),
            ("ssl.key.password", self.ssl_key_password),
        ):
            if secret is not None:
                config[key] = secret.get_secret_value()
        return config


def default_instance_id(state_dir: Path) -> str:
    """Stable across restarts of the same sidecar, distinct for two sidecars on one host."""
    digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:8]
    return f"{socket.gethostname()}-{digest}"


class RunSettings(KafkaSettings):
    bootstrap_servers: str | None = Field(
        None, description="Kafka bootstrap servers. Unset: start a local broker (--broker-kind) on --broker-port"
    )
    policies: Path = Field(Path("policies"), description="Policy YAML file or directory of files")
    state_dir: Path = Field(
        Path(".state"),
        description="Directory for the delayed index, the payload cache and the local broker's data "
        "(<state-dir>/kafka for Apache Kafka, <state-dir>/broker for noida-db)",
    )
    metrics_port: int = Field(9464, ge=0, le=65535, description="Port of /metrics, /healthz, /policies (0: off)")
    metrics_host: str = Field("127.0.0.1", description="Address the metrics endpoint binds to")
    group_id: str = Field("delay-sidecar", description="Consumer group of the inbound and control topics")
    instance_id: str | None = Field(
        None,
        description="Static group member id (group.instance.id): a restarted sidecar takes its partitions back "
        "at once. Default: derived from the host name and the state dir.",
    )
    leave_group_on_stop: CliImplicitFlag[bool] = Field(
        False,
        description="On a clean stop, leave the consumer group so the other members take this sidecar's partitions "
        "at once (scale-down). Without it the group keeps them for this static member's restart",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Worker processes to run in one group, one core each, supervised: worker i uses "
        "<state-dir>/worker-<i>, instance id <instance-id>-<i> and metrics port <metrics-port>+1+i; the "
        "supervisor serves its own /metrics on <metrics-port>",
    )
    assignment_strategy: Literal["roundrobin", "range", "cooperative-sticky"] = Field(
        "roundrobin",
        description="How the group spreads partitions over sidecars (librdkafka partition.assignment.strategy). "
        "All members of a group must use the same one. cooperative-sticky moves fewer partitions per "
        "rebalance, but on the embedded broker a static member can then wait forever for its share",
    )
    session_timeout_ms: int = Field(
        SESSION_TIMEOUT_MS,
        ge=1000,
        description="How long the group waits for a vanished sidecar before moving its partitions. Kafka's "
        "default; below about 20 s, one broker's death can end the session of a sidecar that is alive",
    )
    broker_port: int = Field(
        9092,
        ge=1,
        le=65535,
        description="Port of the local broker (without bootstrap servers); taken: a free one, as the log says",
    )
    broker_kind: BrokerKind = Field("auto", description=KIND_HELP + " (without bootstrap servers)")
    tracker: Literal["bucket", "memory"] = Field(
        "bucket",
        description="Delayed index: 'bucket' (PIP-195, RocksDB snapshots under the state dir, restarts without "
        "replaying the log) or 'memory' (rebuilt from the log after every restart)",
    )
    bucket_min_index_count: int = Field(
        50_000, ge=1, description="Entries the mutable bucket holds before it can be sealed into a snapshot"
    )
    bucket_time_step_ms: int = Field(300_000, ge=1, description="Delivery time covered by one snapshot segment")
    bucket_max_indexes_per_segment: int = Field(5_000, ge=1, description="Most entries in one snapshot segment")
    bucket_max_buckets: int = Field(50, ge=1, description="Sealed buckets per partition before adjacent ones merge")
    control_topic: str = Field(
        "delay-sidecar.control", description="Topic of consumers' commands: nacks, cancels and reschedules"
    )
    state_topic: str | None = Field(
        None,
        description="Compacted topic that holds the bucket snapshots of the group's partitions, so a member "
        "that takes a partition over reads only its unsealed tail from the log. Default: <group-id>.state; "
        "'none': no state topic (a new owner reads the log again from the earliest pending record)",
    )
    commit_interval_ms: int = Field(
        1000,
        ge=10,
        description="How often delivered and indexed inbound offsets are committed; in exactly-once mode also "
        "how often outbound records become visible to read_committed consumers",
    )
    processing_guarantee: Literal["exactly-once", "at-least-once"] = Field(
        "at-least-once",
        description="exactly-once: each checkpoint is one Kafka transaction (outbound, dead-letter and control "
        "records with the inbound offsets), so read_committed consumers see each record once, across crashes; "
        "at-least-once: plain writes and commits, a crash can send a record again",
    )
    read_ahead_ms: int = Field(
        10_000,
        ge=0,
        description="How far ahead of their deliver-at due records are read back from the log (never sent early)",
    )
    payload_cache_bytes: int = Field(
        1 << 30,
        ge=0,
        description="Disk budget of the local payload cache under --state-dir/cache, counted as key + value "
        "bytes before compression; past it, payloads are read back from the log (0: no cache)",
    )
    recent_records_bytes: int = Field(
        64 << 20,
        ge=0,
        description="Memory for the inbound records read last, counted as value bytes plus about 350 per record: "
        "a nack of a message delivered since is redelivered without reading it back from the log (0: none kept)",
    )
    payload_cache_horizon_ms: int = Field(
        600_000,
        ge=0,
        description="Delayed records due within this time of their intake keep their payload in the payload "
        "cache; later ones are read back from the log ahead of their deliver-at",
    )
    batch_size: int = Field(10_000, ge=1, description="Most records read per poll of the inbound topics")
    idle_fetch_pause_ms: int | None = Field(
        None,
        ge=0,
        le=1_000,
        description="Pause fetching a partition whose end was reached for this long between short fetches, "
        "for brokers that answer an empty fetch at once instead of holding it (noida-db); a record arriving "
        "then is read this much later. Default: 10 on a noida-db the sidecar starts itself, else 0 (never "
        "pause: a Kafka broker holds the fetch, and pausing there costs more than it saves)",
    )
    monotone_runs: CliImplicitFlag[bool] = Field(
        False,
        description="Deprecated and ignored (a warning at start): monotone runs were removed, as the index "
        "delivered faster and later by less on Apache Kafka (see the docs, Tuning)",
    )
    outbound_headers: Literal["compact", "v1"] = Field(
        "compact",
        description="Header form of deliveries: compact (delay-origin: topic/partition/offset, delay-deliver-at, "
        "and delay-redelivery-count above 0) or v1 (delay-origin-topic, -partition and -offset, and the count "
        "always), for consumers written against the first form",
    )
    compression_type: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        "lz4", description="Compression of the records the sidecar writes (librdkafka compression.type)"
    )
    linger_ms: int = Field(
        5,
        ge=0,
        le=900_000,
        description="How long the producer waits to fill a batch (librdkafka linger.ms): more throughput in "
        "bursts, that much more lateness",
    )
    new_topic_partitions: int = Field(
        3,
        ge=1,
        description="Partitions of the inbound and control topics the sidecar creates because they did not exist "
        "(with the control topic's dead-letter and outcomes topics; outbound topics follow their inbound topic)",
    )
    replication_factor: int | None = Field(
        None,
        ge=1,
        description="Replication factor of the topics the sidecar creates (inbound, outbound, dead-letter, "
        "control, state); min.insync.replicas is one less, at least 1",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level")

    @property
    def state_topic_name(self) -> str | None:
        """The state topic in force: None with --state-topic none or the in-memory tracker."""
        if self.tracker != "bucket" or (self.state_topic or "").lower() == "none":
            return None
        return self.state_topic or f"{self.group_id}.state"
