"""The one producer: records to subscriptions' outbound topics, dead-letter records, accepted nacks.

One partition in, the same partition out: an outbound topic with as many partitions as its inbound
topic gets each record on the inbound record's partition number, so a consumer of one outbound
partition sees one inbound partition's records in order. An outbound topic with another count
falls back to hashing by key, which keeps per-key order only; `partition_map` says which.
"""

import logging
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from sidecar.errors import BrokerError
from sidecar.outbound.records import OutHeaders, dead_letter_headers

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0
ANY_PARTITION = -1


class Writer:
    def __init__(
        self, client_config: dict[str, Any], librdkafka_logger: logging.Logger, tuning: dict[str, Any] | None = None
    ) -> None:
        """`tuning`: librdkafka producer settings the operator chose (compression, linger)."""
        self._errors: list[str] = []
        self._same_partition: set[str] = set()
        self.producer = Producer(
            {
                **client_config,
                "enable.idempotence": True,
                "linger.ms": 5,
                "compression.type": "lz4",
                "partitioner": "murmur2_random",  # the Java client's partitioner: same key, same partition
                "queue.buffering.max.messages": 1_000_000,
                "delivery.report.only.error": True,
                "on_delivery": self._on_delivery,
                **(tuning or {}),
            },
            logger=librdkafka_logger,
        )

    def partition_map(self, inbound: dict[str, int], outbound: dict[str, tuple[str, int]]) -> None:
        """Which outbound topics keep the inbound partition: {outbound: (inbound topic, partitions)}."""
        same = set()
        for topic, (source, count) in outbound.items():
            if inbound.get(source) == count:
                same.add(topic)
            elif source in inbound:
                logger.warning(
                    "outbound topic has a different partition count from its inbound topic; records are "
                    "partitioned by key, so order holds per key only topic=%s partitions=%d inbound=%s "
                    "inbound_partitions=%d",
                    topic,
                    count,
                    source,
                    inbound[source],
                )
        self._same_partition = same

    def target(self, topic: str, partition: int) -> int:
        """The outbound partition for a record from inbound `partition` (ANY_PARTITION: by key)."""
        return partition if topic in self._same_partition else ANY_PARTITION

    def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: OutHeaders,
        partition: int = ANY_PARTITION,
        timestamp: int = 0,
    ) -> None:
        """Produce, waiting for room when the local queue is full."""
        while True:
            try:
                self.producer.produce(topic, value, key, headers=headers, partition=partition, timestamp=timestamp)
                return
            except BufferError:
                self.producer.poll(0.05)  # the local queue is full: let the broker catch up

    def dead_letter(self, topic: str, record: Message, code: str, message: str) -> None:
        """`record` unchanged on `topic`, with the error code and message and its origin."""
        partition = record.partition()
        headers = dead_letter_headers(record.headers(), record.topic(), partition, record.offset(), code, message)
        self.send(topic, record.key(), record.value(), headers, self.target(topic, partition), _timestamp(record))

    def poll(self) -> None:
        self.producer.poll(0)

    def flush(self) -> None:
        """Every record written so far acknowledged, or BrokerError: nothing may be committed then."""
        remaining = self.producer.flush(FLUSH_TIMEOUT_S)
        if remaining:
            raise BrokerError(
                f"{remaining} records not acknowledged after {FLUSH_TIMEOUT_S:.0f}s; the broker is "
                "unreachable or overloaded. Nothing past the last checkpoint was committed."
            )
        if self._errors:
            errors, self._errors = self._errors[:5], []
            raise BrokerError(
                f"writes failed ({'; '.join(errors)}); check topic permissions and broker health. "
                "Nothing past the last checkpoint was committed; a restart resumes there."
            )

    def close(self, clean: bool = True) -> None:
        """Wait for what is queued after a clean stop; after a failure, drop it: the next engine
        starts again from the last checkpoint, which is exactly what was acknowledged."""
        if clean:
            self.producer.flush(FLUSH_TIMEOUT_S)
        else:
            self.producer.purge()
            self.producer.flush(0)

    def _on_delivery(self, error: KafkaError | None, record: Message) -> None:
        if error is not None:
            self._errors.append(f"{record.topic()}: {error}")


def _timestamp(record: Message) -> int:
    return max(int(record.timestamp()[1]), 0)
