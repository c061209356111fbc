"""The one producer: records to subscriptions' outbound topics, dead-letter records, accepted nacks.

One partition in, the same partition out: an outbound topic with as many partitions as its inbound
topic gets each record on the inbound record's partition number, so a consumer of one outbound
partition sees one inbound partition's records in order. An outbound topic with another count
falls back to hashing by key, which keeps per-key order only; `partition_map` says which.

In exactly-once mode the producer is transactional: everything written between two checkpoints is
one transaction, committed with the inbound offsets (`commit`), so a crash anywhere leaves either
both the records and the offsets, or neither. The transactional.id is stable per instance, so the
instance's next producer fences this one: a zombie can write, but never commit.
"""

import logging
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from sidecar.errors import BrokerError, Fenced
from sidecar.outbound.records import OutHeaders, dead_letter_headers

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0
TRANSACTION_TIMEOUT_S = 30.0
ANY_PARTITION = -1
# A transaction open this long (a stalled process) is aborted by the broker.
TRANSACTION_TIMEOUT_MS = 60_000
_FENCED = {KafkaError._FENCED, KafkaError.INVALID_PRODUCER_EPOCH, KafkaError.PRODUCER_FENCED}


class Writer:
    def __init__(
        self,
        client_config: dict[str, Any],
        librdkafka_logger: logging.Logger,
        transactional_id: str | None = None,
        tuning: dict[str, Any] | None = None,
    ) -> None:
        """`tuning`: librdkafka producer settings the operator chose (compression, linger)."""
        self._errors: list[str] = []
        self._same_partition: set[str] = set()
        self.transactional_id = transactional_id
        config = {
            **client_config,
            "enable.idempotence": True,
            "linger.ms": 5,
            "compression.type": "lz4",
            "partitioner": "murmur2_random",  # the Java client's partitioner: same key, same partition
            "queue.buffering.max.messages": 1_000_000,
            "delivery.report.only.error": True,
            "on_delivery": self._on_delivery,
            **(tuning or {}),
        }
        if transactional_id is not None:
            config["transactional.id"] = transactional_id
            config["transaction.timeout.ms"] = TRANSACTION_TIMEOUT_MS
        self.producer = Producer(config, logger=librdkafka_logger)
        self._open = False
        if transactional_id is not None:
            # Fences every earlier producer of this id and aborts what it left open.
            self._transaction(lambda: self.producer.init_transactions(TRANSACTION_TIMEOUT_S), "init")
            self._begin()

    @property
    def transactional(self) -> bool:
        return self.transactional_id is not None

    def commit(self, offsets: list[TopicPartition], group_metadata: object) -> None:
        """Commit the records written since the last commit together with `offsets`, then begin
        the next transaction. On failure nothing of this transaction is visible: BrokerError."""
        self.flush()
        producer = self.producer
        if offsets:
            self._transaction(
                lambda: producer.send_offsets_to_transaction(offsets, group_metadata, TRANSACTION_TIMEOUT_S),
                "send offsets",
            )
        self._transaction(lambda: producer.commit_transaction(TRANSACTION_TIMEOUT_S), "commit")
        self._open = False
        self._begin()

    def abort(self) -> None:
        """Drop the open transaction: none of its records becomes visible to read_committed readers."""
        if not self._open:
            return
        self._open = False
        try:
            self.producer.purge()
            self.producer.abort_transaction(TRANSACTION_TIMEOUT_S)
        except KafkaException as e:
            # Fenced or failed: the broker aborts it anyway, when the next producer of this id starts.
            logger.warning("aborting the transaction failed error=%s", e.args[0])

    def _begin(self) -> None:
        self._transaction(self.producer.begin_transaction, "begin")
        self._open = True

    def _transaction(self, call: Any, what: str) -> None:
        """One transactional call; a retriable error is retried, everything else ends this producer."""
        for attempt in range(3):
            try:
                call()
                return
            except KafkaException as e:
                error: KafkaError = e.args[0]
                if error.code() in _FENCED:
                    self._open = False
                    raise Fenced(
                        f"transaction {what} fenced: another sidecar started with transactional.id "
                        f"{self.transactional_id!r} ({error}). This engine stops writing and starts again; if "
                        "this repeats, two running sidecars share an --instance-id or a --state-dir: give each "
                        "its own"
                    ) from e
                if error.retriable() and attempt < 2:
                    logger.warning("transaction call failed; retrying call=%s error=%s", what, error)
                    continue
                raise BrokerError(
                    f"transaction {what} failed ({error}); the transaction is aborted and the sidecar "
                    "starts again from the last commit. Check broker health."
                ) from e

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
            except KafkaException as e:
                if self.transactional and e.args[0].code() == KafkaError._FATAL:
                    # A transactional producer turns fatal when a newer one of its id fenced it.
                    raise Fenced(
                        f"the transactional producer failed for good ({e.args[0]}): another sidecar started "
                        f"with transactional.id {self.transactional_id!r} and fenced this one. This engine "
                        "stops writing and starts again"
                    ) from e
                raise

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
        starts again from the last checkpoint, which is exactly what was acknowledged (in
        exactly-once mode, what was committed: the open transaction is aborted)."""
        if self.transactional:
            self.abort()  # after a clean stop the last checkpoint committed everything
        elif clean:
            self.producer.flush(FLUSH_TIMEOUT_S)
        else:
            self.producer.purge()
            self.producer.flush(0)

    def _on_delivery(self, error: KafkaError | None, record: Message) -> None:
        if error is not None:
            self._errors.append(f"{record.topic()}: {error}")


def _timestamp(record: Message) -> int:
    return max(int(record.timestamp()[1]), 0)
