"""Reading runs (tracker/runs.py) back from the inbound log: in offset order, just ahead of their time.

One consumer, assigned to every partition with pending runs, reads each run's offsets in order and
judges every record again with the rule of its intake; the members, in (deliver-at, offset) order,
wait in a buffer until they fall due. A partition's reading pauses once its buffer holds what falls
due in the next TRAIL_AHEAD_MS, so the buffer holds a moment of records, not the delay's worth:
the reader trails intake by the delay, and its reads are sequential.

Records past the last member intake has judged are not read yet: the reader waits there, and
resumes with a seek when intake has extended the run or opened another.
"""

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from sidecar.errors import BrokerError
from sidecar.kafka_io import LIBRDKAFKA, consumer_config, is_fatal
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker.runs import Run, Runs, step_joins

logger = logging.getLogger(__name__)

# Members read ahead of their deliver-at; reading pauses beyond.
TRAIL_AHEAD_MS = 1_000
# Records taken from the consumer per turn: bounds a turn's reading to a few milliseconds.
READ_PER_TURN = 5_000
# Records between runs read through rather than skipped with a seek (about one fetch's worth).
SEEK_OVER = 2_000
# The reader trails the log end by the runs' delay, so every fetch finds a whole backlog: its own
# limits keep each answer to about a turn's reading (READ_PER_TURN records of a few hundred bytes)
# and what librdkafka queues ahead to a few fetches, instead of the intake's 32 MiB. Apache Kafka
# honours them (a 40 MB partition read in answers of at most 2 MiB); noida-db ignores them (it
# answers with the rest of the partition, 40 MB at once): see README, Monotone runs.
FETCH_LIMITS: dict[str, Any] = {
    "max.partition.fetch.bytes": 1024 * 1024,
    "fetch.max.bytes": 4 * 1024 * 1024,
    "queued.max.messages.kbytes": 4 * 1024,
}

Rejudge = Callable[[TopicPartitionKey, Message], int | None]
"""The deliver-at intake gave a record (its rule, its headers, its timestamp), or None when it was
not delayed or carries no timestamp: not a member, whatever its deliver-at."""
Member = tuple[int, int, Message, Run]
"""(deliver-at, offset, record, its run)."""


@dataclass
class _Lane:
    """The reader's state for one partition."""

    members: deque[Member] = field(default_factory=deque)
    expect: int | None = None
    """The offset the consumer delivers next for this partition; None: it must seek first."""
    assigned: bool = False
    paused: bool = False


class TrailReader:
    def __init__(self, client_config: dict[str, Any], rejudge: Rejudge, on_lost: Callable[[str, int], None]) -> None:
        self.rejudge = rejudge
        self._on_lost = on_lost
        self._lanes: dict[TopicPartitionKey, _Lane] = {}
        self._consumer = Consumer(
            consumer_config(
                client_config,
                **{
                    # Never commits: positions come from the runs.
                    "group.id": "delay-sidecar.trail-reader",
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "auto.offset.reset": "earliest",
                    "fetch.wait.max.ms": 10,
                    **FETCH_LIMITS,
                },
            ),
            logger=LIBRDKAFKA,
        )

    @property
    def reading(self) -> bool:
        """Partitions are still assigned (fill with no runs releases them)."""
        return bool(self._lanes)

    def members(self, partition: TopicPartitionKey) -> deque[Member]:
        """The members read for `partition` and not delivered yet, in key order; the caller takes
        them from the left as they go out."""
        lane = self._lanes.get(partition)
        if lane is None:
            lane = self._lanes[partition] = _Lane()
        return lane.members

    def next_time(self, partition: TopicPartitionKey) -> int | None:
        lane = self._lanes.get(partition)
        return lane.members[0][0] if lane is not None and lane.members else None

    def fill(self, runs: dict[TopicPartitionKey, Runs[Message]], now_ms: int) -> None:
        """Read the next records of every partition that needs members, a bounded amount per turn."""
        wanting = False
        for partition, partition_runs in runs.items():
            lane = self._lanes.get(partition)
            if lane is None:
                lane = self._lanes[partition] = _Lane()
            want = _next_to_read(partition_runs)
            needs = want is not None and (not lane.members or lane.members[-1][0] <= now_ms + TRAIL_AHEAD_MS)
            if needs and (lane.expect is None or lane.paused):
                assert want is not None
                self._position(partition, lane, want)
            elif not needs and lane.assigned and not lane.paused:
                self._consumer.pause([TopicPartition(*partition)])
                lane.paused = True
            wanting = wanting or needs
        for partition in [p for p in self._lanes if p not in runs]:
            self.forget(partition)
        if not wanting:
            return
        for record in self._consumer.consume(READ_PER_TURN, 0):
            partition = (record.topic(), record.partition())
            lane = self._lanes.get(partition)
            owner = runs.get(partition)
            if lane is None or owner is None:
                continue
            error = record.error()
            if error is not None:
                if is_fatal(error):
                    raise BrokerError(f"reading runs back failed for good: {error}; restart the sidecar")
                if error.code() != KafkaError._PARTITION_EOF:
                    logger.warning("run read error partition=%s/%d error=%s", *partition, error)
                continue
            self._judge(partition, lane, owner, record)

    def _position(self, partition: TopicPartitionKey, lane: _Lane, offset: int) -> None:
        tp = TopicPartition(partition[0], partition[1], offset)
        if not lane.assigned:
            self._consumer.incremental_assign([tp])
            # A partition paused before it was unassigned comes back paused: librdkafka keeps that.
            self._consumer.resume([TopicPartition(*partition)])
            lane.assigned = True
        else:
            if lane.paused:
                self._consumer.resume([TopicPartition(*partition)])
            self._consumer.seek(tp)
        lane.paused = False
        lane.expect = offset

    def _judge(self, partition: TopicPartitionKey, lane: _Lane, runs: Runs[Message], record: Message) -> None:
        offset = record.offset()
        if lane.expect is None or offset < lane.expect:
            return  # fetched before a seek: not the place reading is at
        for run in runs.runs:
            if run.read_next > run.last:
                continue  # read through
            if offset < run.read_next:
                if run.read_next - offset > SEEK_OVER:
                    self._position(partition, lane, run.read_next)
                return  # between runs
            if offset <= run.last:
                break
            if runs.open and run is runs.runs[-1]:
                self._wait(partition, lane)  # intake has not judged this record yet
                return
            self._passed(partition, lane, run)
        else:
            self._wait(partition, lane)
            return
        lane.expect = offset + 1
        deliver_at = self.rejudge(partition, record)
        if deliver_at is not None and step_joins(run.read_top, deliver_at):
            lane.members.append((deliver_at, offset, record, run))
            run.read_top = deliver_at
        run.read_next = offset + 1

    def _passed(self, partition: TopicPartitionKey, lane: _Lane, run: Run) -> None:
        """Reading went past a run's last offset (a gap in the log): members not found are gone."""
        run.read_next = run.last + 1
        found = sum(1 for m in lane.members if m[3] is run)
        missing = run.members - found
        if missing > 0:
            self._on_lost(f"{partition[0]}/{partition[1]}", missing)
            run.members = found

    def _wait(self, partition: TopicPartitionKey, lane: _Lane) -> None:
        if not lane.paused:
            self._consumer.pause([TopicPartition(*partition)])
            lane.paused = True
        lane.expect = None

    def forget(self, partition: TopicPartitionKey) -> None:
        """The partition was revoked (or has no runs left): drop what was read for it."""
        lane = self._lanes.pop(partition, None)
        if lane is not None and lane.assigned:
            try:
                self._consumer.incremental_unassign([TopicPartition(*partition)])
            except Exception as exc:  # not assigned after all: nothing to undo
                logger.debug("trail unassign failed partition=%s/%d error=%s", *partition, exc)

    def close(self) -> None:
        self._consumer.close()


def _next_to_read(runs: Runs[Message]) -> int | None:
    """The offset the next member can be at, or None when every member intake judged is read."""
    for run in runs.runs:
        if run.read_next <= run.last:
            return run.read_next
    return None
