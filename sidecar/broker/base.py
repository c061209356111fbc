"""The launcher interface: the sidecar, the demo and the tests get a cluster the same way."""

import time
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, Self

from confluent_kafka.admin import AdminClient

from sidecar.errors import BrokerError
from sidecar.kafka_io import LIBRDKAFKA


class BrokerLauncher(ABC):
    bootstrap_servers: str

    @abstractmethod
    def start(self) -> str:
        """Make the cluster available and return its bootstrap servers."""

    @abstractmethod
    def stop(self) -> None: ...

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def wait_for_metadata(bootstrap_servers: str, timeout_s: float, client_config: dict[str, Any] | None = None) -> None:
    """Block until the cluster answers a metadata request; a listening port is not enough."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **(client_config or {})}, logger=LIBRDKAFKA)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if admin.list_topics(timeout=1.0).brokers:
                return
        except Exception as e:  # the client raises KafkaException or a timeout while starting
            last = e
        time.sleep(0.1)
    raise BrokerError(
        f"no Kafka broker answered metadata requests at {bootstrap_servers} within {timeout_s:.0f}s "
        f"({last}); check the address and that the broker is running"
    )
