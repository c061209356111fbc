"""The launcher interface: the sidecar, the demo and the tests get a cluster the same way."""

import logging
import threading
import time
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, Self

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from sidecar.errors import BrokerError, ConfigError
from sidecar.kafka_io import RepeatFilter


class BrokerLauncher(ABC):
    bootstrap_servers: str

    @property
    def description(self) -> str:
        """What kind of broker this is, for logs and reports (a test run prints it)."""
        return f"Kafka at {self.bootstrap_servers}"

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


CONNECT_LOGGER = logging.getLogger("librdkafka.connect")
CONNECT_LOGGER.addFilter(RepeatFilter())


class _SecurityFailure(logging.Handler):
    """Keeps the client's last authentication or TLS failure: librdkafka reports those only in its log."""

    MARKERS = ("authentication", "SSL", "handshake", "security.protocol", "SASL")

    def __init__(self) -> None:
        super().__init__()
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if any(marker in text for marker in self.MARKERS):
            self.message = text.split("]: ", 1)[-1]


def wait_for_metadata(
    bootstrap_servers: str,
    timeout_s: float,
    client_config: dict[str, Any] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Block until the cluster answers a metadata request; a listening port is not enough.

    Settings the client refuses, and authentication or TLS failures, end the wait at once with
    their cause (ConfigError); a stop request ends it quietly.
    """
    failure = _SecurityFailure()
    logger = CONNECT_LOGGER
    logger.addHandler(failure)
    try:
        try:
            admin = AdminClient({"bootstrap.servers": bootstrap_servers, **(client_config or {})}, logger=logger)
        except KafkaException as e:
            raise ConfigError(
                f"the Kafka client refused its settings: {e.args[0].str()}; check --security-protocol, "
                "--sasl-mechanism and --ssl-ca-location (a CA file must exist and be PEM)"
            ) from None
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                return
            try:
                if admin.list_topics(timeout=1.0).brokers:
                    return
            except Exception as e:  # the client raises KafkaException or a timeout while starting
                last = e
            admin.poll(0)
            if failure.message is not None:
                raise ConfigError(
                    f"Kafka at {bootstrap_servers} refused the connection: {failure.message}; check that "
                    "--security-protocol matches the broker's listener, and --sasl-mechanism, --sasl-username, "
                    "--sasl-password and --ssl-ca-location"
                )
            time.sleep(0.1)
        raise BrokerError(
            f"no Kafka broker answered metadata requests at {bootstrap_servers} within {timeout_s:.0f}s "
            f"({last}); check the address and that the broker is running"
        )
    finally:
        logger.removeHandler(failure)
