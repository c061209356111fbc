"""From due index entries to outbound records, with payloads fetched ahead of their time.

Reading a record back costs a fetch, and records with random delays lie all over the log, so
reading them only when they fall due would make every delivery wait for a pass over the log. The
dispatcher therefore peeks at the entries that fall due within the read-ahead window (without
removing them from the tracker), reads their payloads in one pass, a slice per loop turn, and
keeps them in a bounded cache. Records that were near due at intake are cached without any read.

Delivery itself is unchanged by this: an entry is popped only when the clock has passed its
deliver-at, and sent in the same turn, with its payload from the cache or, if it is not there,
read at once. Pops and checkpoints therefore keep their simple meaning, and reading ahead can
never mean delivering early.
"""

import logging
import time
from collections.abc import Callable, Iterator

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.dispatch.reader import LogReader, ReadInterrupted, TopicPartitionKey
from sidecar.tracker import DelayedDeliveryTracker, Due

logger = logging.getLogger(__name__)

Deliver = Callable[[TopicPartitionKey, list[tuple[int, int, Message | None]]], None]
"""deliver(partition, [(deliver_at, offset, record), ...]) in deliver-at order; record is None when
the log no longer has it."""

# Most due entries popped from one tracker per turn, so intake keeps flowing while a burst drains.
MAX_POP = 100_000
# Time a turn spends pulling records from the read-ahead before it lets intake and sending run.
READ_SLICE_S = 0.01
# Payloads held for upcoming deliveries (about 300 bytes each with 100-byte values); past this,
# due records are read back when they fall due.
MAX_CACHED = 300_000
# A tracker whose next snapshot segment failed to load reports a due entry it cannot pop yet; wait
# this long for its retry rather than spin.
STALL_WAIT_MS = 50
# Look ahead at most this often, so an idle sidecar with distant entries does not spin. Beyond that,
# a new pass starts only when what was read ahead covers less than half the window: with random
# delays a pass reads through most of the log, so each pass should cover a lot of due time.
LOOK_AHEAD_EVERY_MS = 100
# Later than any deliver-at (year 9999): draining pops every entry.
DRAIN_UNTIL_MS = 253_402_300_800_000


class Dispatcher:
    def __init__(
        self, ahead: LogReader, due: LogReader, deliver: Deliver, clock: Clock, read_ahead_ms: int = 10_000
    ) -> None:
        self._ahead_reader = ahead
        self._due_reader = due
        self._deliver = deliver
        self._clock = clock
        self.read_ahead_ms = read_ahead_ms
        self._cache: dict[tuple[TopicPartitionKey, int], Message | None] = {}
        self._horizon: dict[TopicPartitionKey, Due] = {}
        self._read: Iterator[tuple[TopicPartitionKey, int, Message | None]] | None = None
        self._next_look_ms = 0
        self._stalled_until_ms = 0

    # ----------------------------------------------------------------- what the loop asks

    def near(self, deliver_at: int, now: int) -> bool:
        return deliver_at <= now + self.read_ahead_ms

    def keep_payload(self, partition: TopicPartitionKey, offset: int, record: Message) -> None:
        """A delayed record due within the read-ahead window: keep it so it need not be read back."""
        if len(self._cache) < MAX_CACHED:
            self._cache[(partition, offset)] = record

    def next_wake_ms(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker]) -> int | None:
        """When the loop must run next: now while reading ahead, else the next delivery or read-ahead."""
        if self._read is not None:
            return 0
        times = [t for tracker in trackers.values() if (t := tracker.next_delivery_time()) is not None]
        if not times:
            return None
        if self.read_ahead_ms > 0:
            times.append(max(min(times) - self.read_ahead_ms, self._next_look_ms))
        return max(min(times), self._stalled_until_ms)

    def forget(self, partition: TopicPartitionKey) -> None:
        """The partition was revoked: drop what was read ahead for it."""
        self._horizon.pop(partition, None)
        self._cache = {key: record for key, record in self._cache.items() if key[0] != partition}

    # ----------------------------------------------------------------- one turn of the loop

    def turn(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker]) -> None:
        self._deliver_due(trackers)
        if self._read is None and self.read_ahead_ms > 0 and self._clock.now_ms() >= self._next_look_ms:
            self._start_read_ahead(trackers)
        if self._read is not None:
            self._continue_read_ahead()

    def _deliver_due(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker]) -> None:
        for partition, tracker in trackers.items():
            if not tracker.has_message_available():
                continue
            due = tracker.pop_due(MAX_POP)
            if not due:
                self._stalled_until_ms = self._clock.now_ms() + STALL_WAIT_MS
                continue
            missing = [offset for _, offset in due if (partition, offset) not in self._cache]
            if missing:
                for _, offset, record in self._due_reader.read({partition: missing}):
                    self._cache[(partition, offset)] = record
            cache = self._cache
            self._deliver(partition, [(at, offset, cache.pop((partition, offset))) for at, offset in due])

    def _start_read_ahead(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker]) -> None:
        now = self._clock.now_ms()
        until = now + self.read_ahead_ms
        room = MAX_CACHED - len(self._cache)
        wanted: dict[TopicPartitionKey, list[int]] = {}
        for partition, tracker in trackers.items():
            next_time = tracker.next_delivery_time()
            if room <= 0 or next_time is None or next_time > until:
                continue
            upcoming = tracker.peek(self._horizon.get(partition), until, room)
            if not upcoming:
                continue
            self._horizon[partition] = upcoming[-1]
            offsets = [d.offset for d in upcoming if (partition, d.offset) not in self._cache]
            if offsets:
                wanted[partition] = offsets
                room -= len(offsets)
        if wanted:
            self._read = self._ahead_reader.read(wanted)
        covered = min((h.deliver_at for h in self._horizon.values()), default=now)
        self._next_look_ms = max(now + LOOK_AHEAD_EVERY_MS, covered - self.read_ahead_ms // 2)

    def _continue_read_ahead(self) -> None:
        assert self._read is not None
        deadline = time.monotonic() + READ_SLICE_S
        try:
            for partition, offset, record in self._read:
                if partition in self._horizon:  # still ours
                    self._cache[(partition, offset)] = record
                if time.monotonic() >= deadline:
                    return
        except ReadInterrupted:
            pass  # stopping; nothing read ahead is needed for correctness
        self._read = None

    def drain(
        self, partition: TopicPartitionKey, tracker: DelayedDeliveryTracker, send: Callable[[Message, int], None]
    ) -> int:
        """Pop every entry, due or not, and hand each record to `send(record, deliver_at)`.

        For a topic that left the policies: its pending records are dead-lettered, not dropped.
        """
        self.forget(partition)
        count = 0
        while due := tracker.pop_due(MAX_POP, until_ms=DRAIN_UNTIL_MS):
            at = {d.offset: d.deliver_at for d in due}
            for _, offset, record in self._due_reader.read({partition: list(at)}):
                if record is None:
                    logger.error("pending record missing from the log partition=%s/%d offset=%d", *partition, offset)
                    continue
                send(record, at[offset])
                count += 1
        return count

    def close(self) -> None:
        self._read = None
