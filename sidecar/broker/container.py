"""A throwaway apache/kafka (KRaft, single node) through testcontainers, where a Docker engine answers.

Used by the tests on developer machines with Docker; testcontainers is a dev dependency, so it is
imported only here.
"""

from typing import Any

from sidecar.broker.base import BrokerLauncher, wait_for_metadata

IMAGE = "apache/kafka:3.9.1"


def docker_available() -> bool:
    try:
        import docker  # noqa: PLC0415 - only with the dev dependencies

        client = docker.from_env(timeout=2)
        return bool(client.ping())
    except Exception:
        return False


class ContainerBroker(BrokerLauncher):
    def __init__(self, image: str = IMAGE) -> None:
        self.image = image
        self.bootstrap_servers = ""
        self._container: Any = None

    def start(self) -> str:
        from testcontainers.kafka import KafkaContainer  # noqa: PLC0415

        self._container = KafkaContainer(self.image).with_kraft()
        self._container.start()
        self.bootstrap_servers = str(self._container.get_bootstrap_server())
        wait_for_metadata(self.bootstrap_servers, timeout_s=60)
        return self.bootstrap_servers

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None
