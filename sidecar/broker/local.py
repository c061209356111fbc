"""Which broker to start on this machine when the user names no cluster: Apache Kafka, or noida-db.

Apache Kafka is what users run, so it is the default wherever it can run (Java 17+, and Maven for
the first fetch of its jars). noida-db, the embedded stand-in, needs nothing but this package: it
is the fallback for a machine without Java. One log line says which started and why.
"""

import logging
from pathlib import Path
from typing import Literal

from sidecar.broker.apache import ApacheKafka
from sidecar.broker.base import BrokerLauncher
from sidecar.broker.embedded import EmbeddedBroker, noida_version
from sidecar.broker.jars import KAFKA_VERSION, missing_tools
from sidecar.errors import BrokerError

logger = logging.getLogger(__name__)

BrokerKind = Literal["auto", "apache-kafka", "noida-db"]
KIND_HELP = (
    "Broker to start: apache-kafka (Java 17+, and Maven to fetch it once), noida-db (the embedded "
    "stand-in, for machines without Java), or auto: Apache Kafka where it can run, else noida-db"
)


DATA_DIRS = {"apache-kafka": "kafka", "noida-db": "broker"}
"""Each kind keeps its data in a folder of its own under the state dir: a switch of kind never reads
the other's files."""


def resolve_kind(kind: BrokerKind) -> Literal["apache-kafka", "noida-db"]:
    """The kind `auto` stands for on this machine; an explicit kind that cannot run is an error."""
    missing = missing_tools() if kind != "noida-db" else None
    if kind == "apache-kafka":
        if missing is not None:
            raise BrokerError(f"cannot start Apache Kafka: {missing}; install it, or use --broker-kind noida-db")
        return kind
    if kind == "noida-db" or missing is not None:
        why = "asked for" if kind == "noida-db" else f"{missing}; falling back to the embedded broker"
        logger.info("broker chosen kind=noida-db version=%s why=%r", noida_version(), why)
        return "noida-db"
    logger.info("broker chosen kind=apache-kafka version=%s why=%r", KAFKA_VERSION, "Java 17+ found")
    return "apache-kafka"


def local_broker(
    kind: BrokerKind,
    data_dir: Path | None,
    port: int = 9092,
    host: str = "127.0.0.1",
    nodes: int = 1,
    state_dir: Path = Path(".state"),
) -> BrokerLauncher:
    """A launcher for the broker `kind` resolves to (resolved once: it runs `java -version`), with its
    data under `data_dir`, or under the kind's own folder of `state_dir` (DATA_DIRS)."""
    resolved = resolve_kind(kind)
    data_dir = data_dir or state_dir / DATA_DIRS[resolved]
    if resolved == "apache-kafka":
        return ApacheKafka(data_dir, port=port, host=host, nodes=nodes)
    if nodes != 1:
        raise BrokerError(f"noida-db runs a single node, not {nodes}: use --nodes 1, or --broker-kind apache-kafka")
    return EmbeddedBroker(data_dir, port=port, host=host)
