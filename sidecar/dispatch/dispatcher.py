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

With a payload cache (payload_cache.py), both reads look there first, in one scan in key order,
and read back from the log only what it does not hold. Entries are deleted from it after the
checkpoint that made their delivery durable.
"""

import logging
import time
from collections.abc import Callable, Generator

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.dispatch.reader import LogReader, ReadInterrupted, TopicPartitionKey
from sidecar.metrics import Metrics
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
        self,
        ahead: LogReader,
        due: LogReader,
        deliver: Deliver,
        clock: Clock,
        read_ahead_ms: int = 10_000,
        payloads: PayloadCache | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._payloads = payloads
        self._metrics = metrics
        self._ahead_reader = ahead
        self._due_reader = due
        self._deliver = deliver
        self._clock = clock
        self.read_ahead_ms = read_ahead_ms
        self._cache: dict[tuple[TopicPartitionKey, int], Message | None] = {}
        self._horizon: dict[TopicPartitionKey, Due] = {}
        self._read: Generator[tuple[TopicPartitionKey, int, Message | None]] | None = None
        self._next_look_ms = 0
        self._stalled_until_ms = 0

    # ----------------------------------------------------------------- what the loop asks

    def near(self, deliver_at: int, now: int) -> bool:
        return deliver_at <= now + self.read_ahead_ms

    def keep_payload(self, partition: TopicPartitionKey, offset: int, record: Message) -> bool:
        """A delayed record due within the read-ahead window: keep it so it need not be read back.

        False when the memory is full: the caller may put it in the payload cache instead.
        """
        if len(self._cache) < MAX_CACHED:
            self._cache[(partition, offset)] = record
            return True
        return False

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
        """Pop every due partition first, so what is not read ahead is fetched in one read for all."""
        popped: dict[TopicPartitionKey, list[Due]] = {}
        missing: dict[TopicPartitionKey, list[Due]] = {}
        cache = self._cache
        for partition, tracker in trackers.items():
            if not tracker.has_message_available():
                continue
            due = tracker.pop_due(MAX_POP)
            if not due:
                self._stalled_until_ms = self._clock.now_ms() + STALL_WAIT_MS
                continue
            popped[partition] = due
            absent = [d for d in due if (partition, d.offset) not in cache]
            if absent:
                missing[partition] = absent
        if missing:
            # Entries the read-ahead could not see (not yet loaded from the index) are read here;
            # the rest of their cache slots comes along for the next turns.
            after = {partition: popped[partition][-1] for partition in missing}
            for partition, offset, record in self._fetch(self._due_reader, missing, after):
                cache[(partition, offset)] = record
        for partition, due in popped.items():
            self._deliver(partition, [(at, offset, cache.pop((partition, offset))) for at, offset in due])

    def _fetch(
        self,
        reader: LogReader,
        wanted: dict[TopicPartitionKey, list[Due]],
        after: dict[TopicPartitionKey, Due] | None = None,
    ) -> Generator[tuple[TopicPartitionKey, int, Message | None]]:
        """Payloads from the payload cache (one scan in key order), then the rest read back from the log.

        With `after`, the cache may also yield payloads not asked for that fall due after it
        (see PayloadCache.read), as long as memory has room for them.
        Counts where each payload came from in payload_reads_total, when the read is over.
        """
        rest: dict[TopicPartitionKey, list[int]]
        cached: dict[str, int] = {}
        logged: dict[str, int] = {}
        try:
            if self._payloads is not None:
                room = MAX_CACHED - len(self._cache) if after else 0
                lookup = self._payloads.read(wanted, after, room, self._cache)
                yield from lookup
                cached = lookup.hits
                rest = lookup.missing()
            else:
                rest = {partition: [d.offset for d in dues] for partition, dues in wanted.items()}
            for partition, offset, record in reader.read(rest):
                if record is not None:
                    logged[partition[0]] = logged.get(partition[0], 0) + 1
                yield partition, offset, record
        finally:
            if self._metrics is not None:
                reads = self._metrics.payload_reads
                for source, counts in (("cache", cached), ("log", logged)):
                    for topic, n in counts.items():
                        self._metrics.child(reads, topic, source).inc(n)

    def checkpointed(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker]) -> None:
        """A checkpoint made the deliveries so far durable: delete their payloads from the cache.

        Everything due before the earliest entry still indexed has been popped, so delivered; a
        payload deleted too eagerly (a partition still rebuilding its index) is only read back.
        """
        if self._payloads is None:
            return
        pending = [t for tracker in trackers.values() if (t := tracker.next_delivery_time()) is not None]
        self._payloads.delete_before(min(pending, default=self._clock.now_ms()))
        if self._metrics is not None:
            self._metrics.payload_cache_bytes.set(self._payloads.budget.used)

    def _start_read_ahead(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker]) -> None:
        now = self._clock.now_ms()
        until = now + self.read_ahead_ms
        room = MAX_CACHED - len(self._cache)
        wanted: dict[TopicPartitionKey, list[Due]] = {}
        for partition, tracker in trackers.items():
            next_time = tracker.next_delivery_time()
            if room <= 0 or next_time is None or next_time > until:
                continue
            upcoming = tracker.peek(self._horizon.get(partition), until, room)
            if not upcoming:
                continue
            self._horizon[partition] = upcoming[-1]
            absent = [d for d in upcoming if (partition, d.offset) not in self._cache]
            if absent:
                wanted[partition] = absent
                room -= len(absent)
        if wanted:
            self._read = self._fetch(self._ahead_reader, wanted)
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
        if self._read is not None:
            self._read.close()  # counts what it read
        self._read = None
