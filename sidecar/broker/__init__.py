"""Broker launchers: where the Kafka cluster comes from (Apache Kafka or noida-db started here, or external)."""

from sidecar.broker.apache import ApacheKafka
from sidecar.broker.base import BrokerLauncher
from sidecar.broker.embedded import EmbeddedBroker
from sidecar.broker.external import ExternalBroker
from sidecar.broker.local import BrokerKind, local_broker

__all__ = ["ApacheKafka", "BrokerKind", "BrokerLauncher", "EmbeddedBroker", "ExternalBroker", "local_broker"]
