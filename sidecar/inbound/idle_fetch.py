"""Pausing the inbound consumer's partitions while they have nothing to read.

A Kafka broker holds a fetch at the end of a partition for up to `fetch.wait.max.ms`, so an idle
consumer costs little. Some Kafka-compatible brokers answer at once instead: noida-db, the
fallback broker, answered 16,000 empty fetches a second to one idle consumer here, which cost that
consumer 0.44 of a core and the broker 0.38 of one. The sidecar's consumer is idle most of the
time (between bursts, and all through a burst's drain, when the loop needs the CPU most).

So a partition whose end the consumer has reached (librdkafka reports it) is paused for
`pause_ms`, then resumed and sought to where it stands, which makes librdkafka report its end again
once the next fetch comes back empty: then it is paused again. A record that arrives meanwhile waits
at most `pause_ms` longer, and once records come, the partition fetches as usual until its next end.
While the loop is busy elsewhere, a resumed partition fetches as usual: nothing waits on a timer.
Partitions the engine pauses itself (a removed topic's drain) are left alone: `paced` says which
partitions this may touch.

noida-db needs it: an idle sidecar there spent 0.12 to 0.14 of a core with pauses of 10 ms against
0.52 to 0.55 without, and its broker 0.38 against 0.87 to 0.91, with each partition at its end going
round pause, resume, seek and an empty fetch 30 to 40 times a second. Apache Kafka does not: it
holds the empty fetch, and pausing there cost the sidecar 0.09 to 0.12 of a core against 0.02, for
no saving at the broker (docs/benchmarks.md, "An idle sidecar", 2026-12-02). So app.py pauses by
default only on a noida-db the sidecar starts itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from sidecar.partitions import TopicPartitionKey

logger = logging.getLogger(__name__)

WAKE_TIMEOUT_S = 0.1
"""How long a partition sought to 0 waits for the answer that wakes librdkafka (`_wake`)."""


class Pausable(Protocol):
    def pause(self, partitions: list[TopicPartition]) -> None: ...

    def resume(self, partitions: list[TopicPartition]) -> None: ...

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]: ...

    def seek(self, partition: TopicPartition) -> None: ...

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float | None = None, cached: bool = False
    ) -> tuple[int, int] | None: ...


class IdleFetch:
    def __init__(
        self,
        consumer: Pausable,
        pause_ms: int,
        paced: Callable[[TopicPartitionKey], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consumer = consumer
        self._pause_s = pause_ms / 1000
        self._paced = paced
        self._clock = clock
        self._paused: dict[TopicPartitionKey, float] = {}
        """Partitions paused here, with when to resume them."""
        self._ends: dict[TopicPartitionKey, int] = {}
        """The end each partition paused here last reached: its position while librdkafka's is
        unknown (a seek clears it until a record comes)."""

    @property
    def enabled(self) -> bool:
        return self._pause_s > 0

    def wait_s(self, wait_s: float) -> float:
        """How long the loop may block in the consumer: no longer than the next resume."""
        if not self._paused:
            return wait_s
        return max(0.0, min(wait_s, min(self._paused.values()) - self._clock()))

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """The consumer's positions, with the end a partition reached where a seek made librdkafka's unknown."""
        found = self._consumer.position(partitions)
        return [
            TopicPartition(tp.topic, tp.partition, self._ends[(tp.topic, tp.partition)])
            if tp.offset < 0 and (tp.topic, tp.partition) in self._ends
            else tp
            for tp in found
        ]

    def forget(self, partition: TopicPartitionKey) -> None:
        """The partition was revoked or lost: what was known of its end is not its new owner's."""
        self._paused.pop(partition, None)
        self._ends.pop(partition, None)

    def take(self, records: list[Message]) -> list[Message]:
        """The consumed records without end-of-partition events; pauses and resumes what is due."""
        if not self.enabled:
            return records
        ends = {(r.topic(), r.partition()): r.offset() for r in records if r.error() is not None and _end(r)}
        # `_end` only for the rare error events: a Python call per record would cost the whole batch.
        kept = [r for r in records if r.error() is None or not _end(r)] if ends else records
        if ends or self._paused:
            self._pace(ends)
        return kept

    def _pace(self, ends: dict[TopicPartitionKey, int]) -> None:
        """`ends`: the partitions whose end this batch reported, with the offset of that end."""
        now = self._clock()
        pause: list[TopicPartitionKey] = []
        ended = [TopicPartition(*p) for p in ends if self._paced(p)]
        # A partition whose records went on after its end in this batch is live again: librdkafka's
        # position has passed the end. Asked of the consumer, not found by a pass over the batch.
        for tp in self._consumer.position(ended) if ended else ():
            partition = (tp.topic, tp.partition)
            offset = ends[partition]
            if tp.offset <= offset:  # at the end, or unknown (a seek since, and nothing read)
                pause.append(partition)
                self._paused[partition] = now + self._pause_s
                self._ends[partition] = offset
        if pause:
            self._consumer.pause([TopicPartition(*p) for p in pause])
        due = [p for p, at in self._paused.items() if at <= now]
        if not due:
            return
        for partition in due:
            del self._paused[partition]
        # Revoked meanwhile, or paused by the engine for itself: not ours to resume.
        resume = [TopicPartition(*p) for p in due if self._paced(p)]
        if not resume:
            return
        self._consumer.resume(resume)
        for tp in self.position(resume):
            # Seeking where it stands makes librdkafka report the end again if nothing came.
            try:
                self._consumer.seek(tp)
            except KafkaException as e:  # it fetches as usual, and is paused at its next end
                logger.debug("idle partition not sought partition=%s/%d error=%s", tp.topic, tp.partition, e)
                continue
            if tp.offset == 0:
                self._wake(tp)

    def _wake(self, partition: TopicPartition) -> None:
        """Make librdkafka fetch a partition just resumed and sought to 0.

        Neither a resume nor a seek to 0 wakes the thread that fetches from the partition's broker:
        librdkafka wakes it when a partition's fetch state changes, and a seek to 0 leaves it as it
        was (a seek above 0 is validated first, which changes it twice). With all of a broker's
        partitions paused at their ends, that thread slept on to its one-second tick, and the first
        record on a partition never written was read up to 0.94 s late. A request queued for that
        broker wakes it too: the partition's end, asked of its leader, after the seek, which returns
        once librdkafka has taken it and the resume before it. The answer is not needed.

        A seek to a logical offset that librdkafka looks up would wake it as well, but the only one
        that lands on 0 whatever the log holds, OFFSET_TAIL of a huge count, stays behind in the
        partition's state: a later reset to the beginning found in librdkafka's cache (an offset
        out of range, after retention) would be cut to 0 too, out of range again, for ever."""
        try:
            self._consumer.get_watermark_offsets(
                TopicPartition(partition.topic, partition.partition), timeout=WAKE_TIMEOUT_S, cached=False
            )
        except KafkaException as e:  # the thread wakes at its tick, as before
            logger.debug("idle partition not woken partition=%s/%d error=%s", partition.topic, partition.partition, e)


def _end(record: Message) -> bool:
    error = record.error()
    return error is not None and error.code() == KafkaError._PARTITION_EOF
