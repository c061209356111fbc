"""Reading due records back from the inbound log by offset, never one seek per message.

The tracker holds positions only; the payload stays in Kafka until it is due. A read sorts the due
offsets, assigns every partition with due offsets at once, fetches them in parallel, reads
through gaps of up to `max_gap` records and seeks only across wider ones.

A partition is unassigned as soon as its wanted offsets are read, and assigned afresh at the next
read, rather than paused and resumed: librdkafka does not wake its fetcher for a resume, nor for a
seek to offset 0 right after one. That is the client's doing, so both brokers need this: a resume
and a seek to 0 waited 0.70 s (median of 8) for the first record on Apache Kafka 4.1.1 and on
noida-db alike, a fresh assignment 0.013 and 0.021 s (librdkafka 2.16). A pause drops what was
fetched ahead anyway, so keeping the partition saved nothing.

The reader takes the shared consumer settings (kafka_io.CONSUMER_DEFAULTS) as they are. Its own
queued.min.messages of 1,000 once kept a suspended read from fetching at a partition's end, which
noida-db answers at once; since the shared setting became 1 (fetch only once the queue is empty),
that override did the opposite: a read suspended near the log end made 5,800 fetches a second on
noida-db and 80 on Apache Kafka, at most one without it, and it read no faster on either.
"""

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from sidecar.clock import Overdue
from sidecar.errors import BrokerError, SidecarError
from sidecar.kafka_io import consume_batch, log_reader
from sidecar.partitions import TopicPartitionKey

logger = logging.getLogger(__name__)


# Reading through a gap of this many 100-byte records costs about what one extra fetch round trip
# costs on a local broker; beyond it a seek is cheaper.
DEFAULT_MAX_GAP = 2_000
# A read that gets nothing (no record, no end of partition) for this long gives up: the engine
# starts again from its last checkpoint, and /healthz says why, rather than wait in silence forever.
READ_ERROR_DEADLINE_S = 30.0


# Asking a partition's end again while the broker cannot answer (a leader moving, a node away)
# before the engine gives up and starts again from its last checkpoint.
END_READ_DEADLINE_S = 30.0
UNKNOWN_FOR_S = 2.0
"""How long the broker must keep saying a partition does not exist before a command about it is refused."""
_NO_SUCH_PARTITION = {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC}


class ReadInterrupted(SidecarError):
    """The sidecar is stopping; nothing read after the last checkpoint is committed."""


class NoSuchPartition(SidecarError):
    """The broker says the topic or partition does not exist: a command about it names no message."""


@dataclass
class _Cursor:
    offsets: list[int]
    index: int = 0


class LogReader:
    def __init__(self, client_config: dict[str, Any], stop: threading.Event, max_gap: int = DEFAULT_MAX_GAP) -> None:
        self._stop = stop
        self._max_gap = max_gap
        self._assigned: set[TopicPartitionKey] = set()
        """Partitions of the read under way whose wanted offsets are not all read yet."""
        # Positions come from the tracker; a wanted offset deleted by retention is reported as gone.
        self._consumer = log_reader(client_config, "delay-sidecar.log-reader")

    def read(
        self, wanted: dict[TopicPartitionKey, list[int]]
    ) -> Iterator[tuple[TopicPartitionKey, int, Message | None]]:
        """Yield (partition, offset, record) for every wanted offset, in offset order per partition.

        record is None when the offset no longer exists in the log (deleted by retention or
        compaction); the caller reports it. Blocks until every offset is resolved or the stop
        event is set (then ReadInterrupted).
        """
        cursors = {key: _Cursor(sorted(set(offsets))) for key, offsets in wanted.items() if offsets}
        if not cursors:
            return
        self._assign(cursors)
        progressed = time.monotonic()
        last_error: KafkaError | None = None
        done = False
        try:
            while cursors:
                if self._stop.is_set():
                    raise ReadInterrupted("stopping while reading due records back")
                if time.monotonic() - progressed > READ_ERROR_DEADLINE_S:
                    raise BrokerError(
                        f"reading due records back got nothing for {READ_ERROR_DEADLINE_S:.0f} s "
                        f"(last error: {last_error}); check that the brokers are up and the inbound topics readable"
                    )
                for record in consume_batch(self._consumer, 10_000, 0.1):
                    key = (record.topic(), record.partition())
                    error = record.error()
                    cursor = cursors.get(key)
                    if cursor is None:
                        continue
                    offsets = cursor.offsets
                    if error is not None:
                        if error.code() != KafkaError._PARTITION_EOF:
                            if last_error is None or last_error.code() != error.code():
                                logger.warning("log read error topic=%s partition=%d error=%s", key[0], key[1], error)
                            last_error = error
                            continue
                        progressed = time.monotonic()
                        if record.offset() <= offsets[cursor.index]:
                            # Everything still wanted lies at or past the end of the log.
                            for offset in offsets[cursor.index :]:
                                yield key, offset, None
                            cursor.index = len(offsets)
                    else:
                        progressed = time.monotonic()
                        offset = record.offset()
                        while cursor.index < len(offsets) and offsets[cursor.index] < offset:
                            yield key, offsets[cursor.index], None
                            cursor.index += 1
                        if cursor.index < len(offsets) and offsets[cursor.index] == offset:
                            yield key, offset, record
                            cursor.index += 1
                        if cursor.index < len(offsets) and offsets[cursor.index] - offset > self._max_gap:
                            self._consumer.seek(TopicPartition(key[0], key[1], offsets[cursor.index]))
                    if cursor.index == len(offsets):
                        del cursors[key]
                        self._unassign([key])
            done = True
        finally:
            if not done:  # interrupted mid-read: the next read starts from scratch
                self._unassign(list(self._assigned))

    def _assign(self, cursors: dict[TopicPartitionKey, _Cursor]) -> None:
        self._consumer.incremental_assign([TopicPartition(t, p, c.offsets[0]) for (t, p), c in cursors.items()])
        self._assigned.update(cursors)

    def _unassign(self, keys: list[TopicPartitionKey]) -> None:
        if keys:
            self._consumer.incremental_unassign([TopicPartition(t, p) for t, p in keys])
            self._assigned.difference_update(keys)

    def read_one(self, topic: str, partition: int, offset: int) -> Message | None:
        """One record back from the log (None: no longer, or not yet, in it), as `read` gives it."""
        for _, _, record in self.read({(topic, partition): [offset]}):
            return record
        return None

    def watermarks(self, topic: str, partition: int, deadline_s: float = END_READ_DEADLINE_S) -> tuple[int, int]:
        """(low, high) offsets of an inbound partition, asked of the broker.

        A failure to answer is asked again, and after `deadline_s` is a BrokerError (the engine starts
        again from its last checkpoint and judges the command again). Before, it counted as an end of
        0: on three nodes a valid nack was refused UNKNOWN_MESSAGE ("has no offset 1 (its end is 0)")
        while its message had been delivered. NoSuchPartition: the partition does not exist."""
        deadline = time.monotonic() + deadline_s
        unknown = Overdue(UNKNOWN_FOR_S)
        while True:
            try:
                low, high = self._consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=5, cached=False
                )
                return int(low), int(high)
            except KafkaException as e:
                error: KafkaError = e.args[0]
                if error.code() in _NO_SUCH_PARTITION:
                    # Also what a client says whose metadata does not have the topic yet: asked again, briefly.
                    if unknown.check(True):
                        raise NoSuchPartition(f"{topic}/{partition} does not exist ({error})") from e
                elif time.monotonic() >= deadline:
                    raise BrokerError(
                        f"cannot read the end of {topic}/{partition} ({error}); check that the brokers are up. "
                        "The engine starts again from its last checkpoint"
                    ) from e
                if self._stop.wait(0.2):
                    raise ReadInterrupted("stopping while asking a partition's end") from e

    def close(self) -> None:
        self._consumer.close()
