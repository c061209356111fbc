"""The horizon roll: payloads of records delayed beyond the cache horizon, brought in as it reaches them.

Intake caches only what falls due within `--payload-cache-horizon-ms`. A record delayed longer is
indexed by position alone; without more, its payload would be read back from the log when it falls
due, one random read among many. So every ROLL_SHARE of the horizon, the roll takes the stretch of
deliver-at that has just come within the horizon and reads, per partition, the offset ranges of the
index that hold such entries (a sealed bucket is one stretch of the log: one sequential read). It
keeps what falls due in that stretch and is still pending, and writes it to the cache. RocketMQ's
TimerLog roll is the same idea.

Only records read before the previous roll are considered: later ones were judged at intake with
the horizon already past this stretch, so their payloads are cached, or the budget was full then.
The roll decides nothing: a payload it misses is read back at due time, as without it. It reads a
slice per loop turn, like the read-ahead, so deliveries never wait behind it.

A partition whose index was restored from the state topic gets a catch-up pass of its own at once
(`adopt`): every pending entry due within the horizon, read from its buckets in offset order.
"""

import logging
import time
from collections.abc import Callable, Generator

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.dispatch.reader import LogReader, ReadInterrupted, TopicPartitionKey
from sidecar.tracker import DelayedDeliveryTracker
from sidecar.tracker.base import pack

logger = logging.getLogger(__name__)

# A roll every this share of the horizon (every minute with the default 10-minute horizon).
ROLL_SHARE = 0.1
READ_SLICE_S = 0.005
# Records judged between two cache writes.
WRITE_EVERY = 5_000
# Offsets asked of the log in one read: a bucket can span millions.
READ_CHUNK = 50_000

Rejudge = Callable[[TopicPartitionKey, Message], int | None]


class HorizonRoll:
    def __init__(self, reader: LogReader, cache: PayloadCache, rejudge: Rejudge, clock: Clock) -> None:
        self._reader = reader
        self._cache = cache
        self._rejudge = rejudge
        self._clock = clock
        self._step_ms = max(int(cache.horizon_ms * ROLL_SHARE), 1_000)
        now = clock.now_ms()
        self._rolled_until = now + cache.horizon_ms
        self._next_roll_ms = now + self._step_ms
        self._cursors: dict[TopicPartitionKey, int] = {}
        """The next offset intake would read, per partition, at the previous roll."""
        self._pass: Generator[None] | None = None
        self._catch_up: dict[TopicPartitionKey, int] = {}
        """Partitions whose index came from the state topic, and the offset their log reread starts at."""

    @property
    def busy(self) -> bool:
        """A pass is under way: the loop should not sleep between turns."""
        return self._pass is not None

    def adopt(self, partition: TopicPartitionKey, below: int) -> None:
        """A partition restored from the state topic: its new owner has none of its payloads. One
        sequential pass over its buckets, below the offset where the log is read again (which
        caches what it reads), caches those due within the horizon."""
        self._catch_up[partition] = below

    def turn(
        self,
        trackers: dict[TopicPartitionKey, DelayedDeliveryTracker],
        cursors: Callable[[], dict[TopicPartitionKey, int]],
    ) -> None:
        if self._pass is None and not self._cache.budget.full:
            ready = {p: below for p, below in self._catch_up.items() if p in trackers}
            if ready:  # (a partition still rebuilding, in exactly-once mode, is not delivering yet)
                now = self._clock.now_ms()
                self._catch_up = {p: b for p, b in self._catch_up.items() if p not in ready}
                self._pass = self._roll(trackers, ready, -1, now + self._cache.horizon_ms, now)
        if self._pass is None:
            now = self._clock.now_ms()
            if now < self._next_roll_ms:
                return
            after, until = self._rolled_until, now + self._cache.horizon_ms
            below = self._cursors
            self._cursors = cursors()  # asked only when a roll starts, not every turn
            self._rolled_until, self._next_roll_ms = until, now + self._step_ms
            if self._cache.budget.full or not below:
                return
            self._pass = self._roll(trackers, below, after, until, now)
        deadline = time.monotonic() + READ_SLICE_S
        try:
            for _ in self._pass:
                if time.monotonic() >= deadline:
                    return
        except ReadInterrupted:
            pass
        self._pass = None

    def forget(self, partition: TopicPartitionKey) -> None:
        self._cursors.pop(partition, None)
        self._catch_up.pop(partition, None)

    def _roll(
        self,
        trackers: dict[TopicPartitionKey, DelayedDeliveryTracker],
        below: dict[TopicPartitionKey, int],
        after: int,
        until: int,
        now: int,
    ) -> Generator[None]:
        """One pass: yields between records so the caller can stop for the turn."""
        batch = self._cache.batch(now)
        started, judged, kept = time.monotonic(), 0, 0
        for partition, tracker in list(trackers.items()):
            cursor = below.get(partition)
            if cursor is None:
                continue
            for first, bucket_last in tracker.ranges_due(after, until):
                end = min(bucket_last, cursor - 1) + 1
                for start in range(first, end, READ_CHUNK):
                    offsets = list(range(start, min(start + READ_CHUNK, end)))
                    for _, offset, record in self._reader.read({partition: offsets}):
                        judged += 1
                        if record is not None and tracker.contains(offset):
                            at = self._rejudge(partition, record)
                            if (
                                at is not None
                                and after < at <= until
                                and pack(at, offset) > tracker.delivered_through()
                            ):
                                batch.add(partition[0], partition[1], offset, at, record, record.headers())
                                kept += 1
                        if judged % WRITE_EVERY == 0:
                            batch.write()
                            batch = self._cache.batch(now)
                        yield
        batch.write()
        if judged:
            logger.info(
                "payload cache roll window_ms=%d-%d read=%d cached=%d seconds=%.1f",
                after,
                until,
                judged,
                kept,
                time.monotonic() - started,
            )
