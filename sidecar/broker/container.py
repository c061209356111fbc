"""A throwaway apache/kafka (KRaft, single node) through testcontainers, where a Docker engine answers.

Used by the tests on developer machines with Docker; testcontainers is a dev dependency, so it is
imported only here.
"""

from typing import Any

from sidecar.broker.base import BrokerLauncher, wait_for_metadata
from sidecar.broker.ports import free_port

IMAGE = "apache/kafka:3.9.1"


def docker_available() -> bool:
    try:
        import docker  # noqa: PLC0415 - only with the dev dependencies

        client = docker.from_env(timeout=2)
        return bool(client.ping())
    except Exception:
        return False


class ContainerBroker(BrokerLauncher):
    """apache/kafka started as a plain container: testcontainers' KafkaContainer knows only
    Confluent's cp-kafka images (its KRaft mode refuses the tag 3.9.1, and its start script runs
    files apache/kafka lacks).

    The host port is chosen before the start, because the broker must advertise the address
    clients reach it at: the same port inside and out, on the Docker host (localhost, as on CI
    runners)."""

    def __init__(self, image: str = IMAGE) -> None:
        self.image = image
        self.bootstrap_servers = ""
        self._container: Any = None

    def start(self) -> str:
        from testcontainers.core.container import DockerContainer  # noqa: PLC0415

        port = free_port()
        self._container = (
            DockerContainer(self.image)
            .with_bind_ports(port, port)
            .with_envs(
                CLUSTER_ID="MkU3OEVBNTcwNTJENDM2Qk",
                KAFKA_NODE_ID="1",
                KAFKA_PROCESS_ROLES="broker,controller",
                KAFKA_LISTENERS=f"PLAINTEXT://:{port},CONTROLLER://:9093",
                KAFKA_ADVERTISED_LISTENERS=f"PLAINTEXT://localhost:{port}",
                KAFKA_LISTENER_SECURITY_PROTOCOL_MAP="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                KAFKA_CONTROLLER_LISTENER_NAMES="CONTROLLER",
                KAFKA_CONTROLLER_QUORUM_VOTERS="1@localhost:9093",
                KAFKA_INTER_BROKER_LISTENER_NAME="PLAINTEXT",
                KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR="1",
                KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR="1",
                KAFKA_TRANSACTION_STATE_LOG_MIN_ISR="1",
                KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS="0",
            )
        )
        self._container.start()
        self.bootstrap_servers = f"localhost:{port}"
        wait_for_metadata(self.bootstrap_servers, timeout_s=90)
        return self.bootstrap_servers

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None
