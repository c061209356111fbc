"""Broker launchers: where the Kafka cluster comes from (embedded, external, or a container)."""

from sidecar.broker.base import BrokerLauncher
from sidecar.broker.embedded import EmbeddedBroker
from sidecar.broker.external import ExternalBroker

__all__ = ["BrokerLauncher", "EmbeddedBroker", "ExternalBroker"]
