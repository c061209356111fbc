"""The one producer: records to subscriptions' outbound topics, dead-letter records, accepted nacks.

One partition in, the same partition out: an outbound topic with as many partitions as its inbound
topic gets each record on the inbound record's partition number, so a consumer of one outbound
partition sees one inbound partition's records in order. An outbound topic with another count
falls back to hashing by key, which keeps per-key order only; `partition_map` says which.

In exactly-once mode the producer is transactional: everything written between two checkpoints is
one transaction, committed with the inbound offsets (`commit`), so a crash anywhere leaves either
both the records and the offsets, or neither. Each producer has a transactional.id of its own
(sidecar/identity.py); before it writes, it opens the ids its instance used before once, which
fences a zombie holding one (it can write, but never commit) and ends what it left open.
"""

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from sidecar.errors import BrokerError, Fenced
from sidecar.identity import TransactionalIds
from sidecar.outbound.records import OutHeaders, dead_letter_headers

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0
TRANSACTION_TIMEOUT_S = 30.0
# librdkafka does not always honour its own timeout: after a broker restart, send_offsets_to_transaction
# waited for a group coordinator for good (checked on noida-db). Every transactional call is bounded here.
# Apache Kafka has not needed the bound so far: after a restart of 4.1.1, send_offsets_to_transaction
# and the commit returned in 3.5 s; kept for the fallback broker, noida-db, and for any hang.
CALL_DEADLINE_S = TRANSACTION_TIMEOUT_S + 5
ANY_PARTITION = -1
# A transaction open this long (a stalled process) is aborted by the broker.
TRANSACTION_TIMEOUT_MS = 60_000
_FENCED = {KafkaError._FENCED, KafkaError.INVALID_PRODUCER_EPOCH, KafkaError.PRODUCER_FENCED}
_PURGED = {KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT}
"""Reports of records this writer dropped on purpose (abort, close)."""
# librdkafka's idempotent producer can be left without a producer id, sending nothing, until
# message.timeout.ms (5 minutes) fails its records (CI: refused an id with COORDINATOR_LOAD_IN_PROGRESS
# a second before the broker stopped; not one of 7,151 records acknowledged in the two minutes after
# it came back). Its statistics say which state it is in; `without_id_s` reads them.
STATS_INTERVAL_MS = 5_000
_ID_STATE = re.compile(r'"idemp_state":\s*"(\w+)"')
_HAS_ID = "Assigned"
_ABANDONED: list[Producer] = []
"""Producers stuck in a call: destroying a librdkafka handle during a call blocks, so they are kept."""


class Writer:
    def __init__(
        self,
        client_config: dict[str, Any],
        librdkafka_logger: logging.Logger,
        ids: TransactionalIds | None = None,
        tuning: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`ids`: exactly-once mode, where this producer's transactional.id comes from.
        `tuning`: librdkafka producer settings the operator chose (compression, linger).
        `clock`: monotonic seconds, for how long the producer has been without an id."""
        self._errors: list[str] = []
        self._clock = clock
        self.id_state = "Init"
        """The idempotent producer's state in librdkafka's last statistics (Assigned: it has an id)."""
        self._had_id_at = clock()
        self._stats: str | None = None
        self._same_partition: set[str] = set()
        self._ids = ids
        self._logger = librdkafka_logger
        self._client_config = client_config
        transactional_id = None
        self.fenced: list[str] = []
        """The earlier transactional ids this writer fenced before it wrote."""
        if ids is not None:
            transactional_id, earlier = ids.next()
            for old in earlier:
                self.fence(old)
            ids.ended(earlier)
            self.fenced = earlier
            logger.info("transactional producer transactional_id=%s fenced=%s", transactional_id, ",".join(earlier))
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
            "statistics.interval.ms": STATS_INTERVAL_MS,
            "stats_cb": self._on_stats,
            **(tuning or {}),
        }
        if transactional_id is not None:
            config["transactional.id"] = transactional_id
            config["transaction.timeout.ms"] = TRANSACTION_TIMEOUT_MS
        self.producer = Producer(config, logger=librdkafka_logger)
        self._open = False
        self._stuck: str | None = None
        """The call that never returned: this producer is abandoned, the engine starts again."""
        if transactional_id is not None:
            self._transaction(lambda: self.producer.init_transactions(TRANSACTION_TIMEOUT_S), "init")
            self._begin()

    def fence(self, transactional_id: str) -> None:
        """Open `transactional_id` once and close it: its producer, if one still runs, can no longer
        commit, and the transaction it left open is aborted, so readers' last stable offset moves on."""
        config = {**self._client_config, "transactional.id": transactional_id}
        config.pop("error_cb", None)
        producer = Producer(config, logger=self._logger)
        what = f"init of the earlier transactional.id {transactional_id!r}"
        try:
            if not _bounded(lambda: producer.init_transactions(TRANSACTION_TIMEOUT_S)):
                _ABANDONED.append(producer)
                raise BrokerError(f"{what} did not return in {CALL_DEADLINE_S:.0f} s; check broker health")
        except KafkaException as e:
            raise BrokerError(
                f"could not end transactional.id {transactional_id!r} left by an earlier run ({e.args[0]}); "
                "nothing is written until it is. Check broker health; the sidecar tries again"
            ) from e
        logger.info("fenced an earlier transactional producer transactional_id=%s", transactional_id)

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
        if not self._open or self._stuck is not None:
            return  # a stuck producer cannot take another call: the next producer fences its id
        self._open = False
        producer = self.producer
        try:
            producer.purge()
            # By this producer: after a broker restart the fallback broker, noida-db, ends a
            # transaction begun since only so, not when a new producer opens the id (found with
            # bench/faults.py; its last stable offset stayed behind it 20 s after such a fence).
            # Apache Kafka does not need this: after a restart of 4.1.1 the fence ended such a
            # transaction too (its init took 1.1 s, this abort 0.2 s).
            if not _bounded(lambda: producer.abort_transaction(TRANSACTION_TIMEOUT_S)):
                self._abandon("abort")
        except KafkaException as e:
            # Fenced or failed: the next producer fences this id, which aborts it on Kafka.
            logger.warning("aborting the transaction failed error=%s", e.args[0])

    def _begin(self) -> None:
        self._transaction(self.producer.begin_transaction, "begin")
        self._open = True

    def _abandon(self, what: str) -> None:
        self._stuck, self._open = what, False
        _ABANDONED.append(self.producer)
        logger.error("transactional call never returned; abandoning the producer call=%s transactional_id=%s",
                     what, self.transactional_id)  # fmt: skip

    def _transaction(self, call: Callable[[], object], what: str) -> None:
        """One transactional call; a retriable error is retried, everything else ends this producer."""
        if self._stuck is not None:
            raise BrokerError(f"the producer is abandoned after its {self._stuck} call hung; the engine starts again")
        for attempt in range(3):
            try:
                if not _bounded(call):
                    self._abandon(what)
                    raise BrokerError(
                        f"transaction {what} did not return in {CALL_DEADLINE_S:.0f} s (the client lost its "
                        "coordinator, as after a broker restart); nothing of this transaction is visible and the "
                        "engine starts again from the last commit with a new producer. Check broker health"
                    )
                return
            except KafkaException as e:
                error: KafkaError = e.args[0]
                if error.code() in _FENCED:
                    self._open = False
                    raise Fenced(
                        f"transaction {what} fenced: a newer sidecar of this instance opened transactional.id "
                        f"{self.transactional_id!r} ({error}). This engine stops writing and starts again; if "
                        "this repeats, two running sidecars share an --instance-id on two hosts: give each its own"
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
        return partition if self.keeps_partition(topic) else ANY_PARTITION

    def keeps_partition(self, topic: str) -> bool:
        """Whether `topic` takes each record on its inbound partition's number (else: by key)."""
        return topic in self._same_partition

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
                        f"the transactional producer failed for good ({e.args[0]}): a newer sidecar of this "
                        f"instance opened transactional.id {self.transactional_id!r}. This engine stops writing "
                        "and starts again"
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
        if not self.acknowledged():
            raise BrokerError(
                f"{len(self.producer)} records not acknowledged after {FLUSH_TIMEOUT_S:.0f}s; the broker is "
                "unreachable or overloaded. Nothing past the last checkpoint was committed."
            )

    def acknowledged(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Whether every record written so far was acknowledged within `timeout_s`; BrokerError when
        a write failed for good (its record never reaches the topic: nothing may be committed)."""
        remaining: int = self.producer.flush(timeout_s)
        if self._errors:
            errors, self._errors = self._errors[:5], []
            raise BrokerError(
                f"writes failed ({'; '.join(errors)}); check topic permissions and broker health. "
                "Nothing past the last checkpoint was committed; a restart resumes there."
            )
        return remaining == 0

    def close(self, clean: bool = True) -> None:
        """Wait for what is queued after a clean stop; after a failure, drop it: the next engine
        starts again from the last checkpoint, which is exactly what was acknowledged (in
        exactly-once mode, what was committed: the open transaction is aborted)."""
        if self._stuck is not None:
            return  # any call may hang on this producer; it is abandoned, its id fenced by the next
        if self.transactional:
            self.abort()  # after a clean stop the last checkpoint committed everything
            if clean and self._ids is not None and self.transactional_id is not None:
                self._ids.ended([self.transactional_id])  # nothing left open: no need to fence it later
        elif clean:
            self.producer.flush(FLUSH_TIMEOUT_S)
        else:
            self.producer.purge()
            self.producer.flush(0)

    def without_id_s(self) -> float:
        """How long this producer has been without a producer id, as its statistics last said: 0
        while it has one. Without one it sends nothing, whatever the brokers' health."""
        if self.id_state == _HAS_ID:
            return 0.0
        return self._clock() - self._had_id_at

    def describe(self) -> str:
        """What librdkafka's last statistics say of the producer, for the log of a checkpoint put off:
        its id's state, each broker's connection, and the partitions with the most records waiting."""
        if self._stats is None:
            return "statistics=none-yet"
        stats = json.loads(self._stats)
        brokers = ",".join(
            f"{b['nodeid']}:{b['state']}" for b in stats.get("brokers", {}).values() if b.get("nodeid", -1) >= 0
        )
        waiting = sorted(
            (
                (p.get("msgq_cnt", 0) + p.get("xmit_msgq_cnt", 0) + p.get("msgs_inflight", 0), name, p)
                for name, topic in stats.get("topics", {}).items()
                for p in topic.get("partitions", {}).values()
            ),
            key=lambda w: -w[0],
        )
        most = ",".join(f"{name}/{p['partition']}@{p.get('leader')}:{n}" for n, name, p in waiting[:5] if n)
        return f"id_state={self.id_state} brokers={brokers or 'none'} waiting={most or 'none'}"

    def _on_stats(self, stats: str) -> None:
        self._stats = stats
        found = _ID_STATE.search(stats)
        if found is None:
            return  # not an idempotent producer's statistics: nothing said either way
        self.id_state = found.group(1)
        if self.id_state == _HAS_ID:
            self._had_id_at = self._clock()

    def _on_delivery(self, error: KafkaError | None, record: Message) -> None:
        if error is not None and error.code() not in _PURGED:
            self._errors.append(f"{record.topic()}: {error}")


def _bounded(call: Callable[[], object]) -> bool:
    """Run `call` on a thread of its own; False when it has not returned by the deadline.

    A daemon thread: a call that never returns must not keep the process from exiting.
    """
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # re-raised on the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="transaction-call", daemon=True)
    thread.start()
    thread.join(CALL_DEADLINE_S)
    if thread.is_alive():
        return False
    if failure:
        raise failure[0]
    return True


def _timestamp(record: Message) -> int:
    return max(int(record.timestamp()[1]), 0)
