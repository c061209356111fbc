"""Reading due records back from the inbound log by offset, never one seek per message.

The tracker holds positions only; the payload stays in Kafka until it is due. A read sorts the due
offsets, assigns every partition with due offsets at once, fetches them in parallel, reads
through gaps of up to `max_gap` records and seeks only across wider ones.
"""

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from sidecar.errors import BrokerError, SidecarError
from sidecar.kafka_io import LIBRDKAFKA, consume_batch, consumer_config

logger = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]

# Reading through a gap of this many 100-byte records costs about what one extra fetch round trip
# costs on a local broker; beyond it a seek is cheaper.
DEFAULT_MAX_GAP = 2_000
# A read that gets nothing (no record, no end of partition) for this long gives up: the engine
# starts again from its last checkpoint, and /healthz says why, rather than wait in silence forever.
READ_ERROR_DEADLINE_S = 30.0
# Partitions kept assigned between reads; past this the reader starts afresh.
MAX_ASSIGNED = 256


class ReadInterrupted(SidecarError):
    """The sidecar is stopping; nothing read after the last checkpoint is committed."""


@dataclass
class _Cursor:
    offsets: list[int]
    index: int = 0


class LogReader:
    def __init__(self, client_config: dict[str, Any], stop: threading.Event, max_gap: int = DEFAULT_MAX_GAP) -> None:
        self._stop = stop
        self._max_gap = max_gap
        self._positions: dict[TopicPartitionKey, int] = {}
        """Partitions assigned (paused between reads) and the offset each delivers next."""
        self._consumer = Consumer(
            consumer_config(
                client_config,
                **{
                    # Never commits: the group id only satisfies the client; positions come from the tracker.
                    "group.id": "delay-sidecar.log-reader",
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "enable.partition.eof": True,
                    # An offset below the log start was deleted by retention: read from the start and
                    # report the wanted offsets that are gone, rather than fail.
                    "auto.offset.reset": "earliest",
                },
            ),
            logger=LIBRDKAFKA,
        )

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
        self._position(cursors)
        positions = self._positions
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
                    if error is None:
                        positions[key] = record.offset() + 1
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
                        positions[key] = record.offset()
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
                        self._consumer.pause([TopicPartition(key[0], key[1])])
            done = True
        finally:
            if not done:  # interrupted mid-read: start the next read from scratch
                self._consumer.unassign()
                positions.clear()

    def _position(self, cursors: dict[TopicPartitionKey, _Cursor]) -> None:
        """Read on from where the last read stopped, when the first wanted offset lies ahead within a
        gap worth reading through; seek otherwise. Due offsets mostly rise from one read to the next,
        and a fresh assignment costs a fetch that starts over (on the embedded broker, one that
        returns the rest of the log)."""
        positions = self._positions
        if len(positions) > MAX_ASSIGNED:
            self._consumer.unassign()
            positions.clear()
        fresh = []
        for (topic, partition), cursor in cursors.items():
            first = cursor.offsets[0]
            at = positions.get((topic, partition))
            tp = TopicPartition(topic, partition, first)
            if at is None:
                fresh.append(tp)
                positions[(topic, partition)] = first
                continue
            self._consumer.resume([TopicPartition(topic, partition)])
            if not at <= first <= at + self._max_gap:
                self._consumer.seek(tp)
                positions[(topic, partition)] = first
        if fresh:
            self._consumer.incremental_assign(fresh)
            # A partition paused before it was unassigned comes back paused: librdkafka keeps that.
            self._consumer.resume([TopicPartition(tp.topic, tp.partition) for tp in fresh])

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        """(low, high) offsets of an inbound partition, asked of the broker."""
        try:
            low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5, cached=False)
        except Exception as e:
            raise SidecarError(f"cannot read the watermarks of {topic}/{partition}: {e}") from e
        return int(low), int(high)

    def close(self) -> None:
        self._consumer.close()
