"""From due index entries to outbound records.

An entry is popped only when the clock has passed its deliver-at, and sent in the same turn, with
its payload from memory (held.py) or, if it is not there, read at once (fetch.py: the payload
cache first, then the log). The read-ahead (read_ahead.py) fills memory before entries fall due,
and records that were near due at intake are held without any read; neither pops, so pops and
checkpoints keep their simple meaning, and reading ahead can never mean delivering early.

Payloads are deleted from the payload cache after the checkpoint that made their delivery durable.

A partition of a keyed topic has a gate (partitions/keyed.py): its entries go only once the log
holds a timestamp at their time, so that no record for the key read later can still replace them.

A partition restored from the state topic on a new owner has no payloads here; the horizon roll's
catch-up pass (roll.py) brings them into the payload cache. While its first read runs (the
payloads due first), nothing is popped from it: each would be another read of the same records.
"""

import logging
from collections.abc import Callable

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.dispatch.fetch import Origins, PayloadFetch
from sidecar.dispatch.held import HeldPayloads
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.dispatch.read_ahead import CatchUp, ReadAhead
from sidecar.dispatch.reader import LogReader
from sidecar.metrics import Metrics
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker import DelayedDeliveryTracker, Due

logger = logging.getLogger(__name__)

Gates = dict[TopicPartitionKey, int]
"""Partitions of keyed topics: the latest deliver-at each may deliver now (partitions/keyed.py)."""

Deliver = Callable[[TopicPartitionKey, list[tuple[int, int, Message | None]]], None]
"""deliver(partition, [(deliver_at, offset, record), ...]) in deliver-at order; record is None when
the log no longer has it."""

# Most due entries popped from one tracker per turn, so intake, due nacks and the consumer's idle
# pauses (IdleFetch) are seen to every few hundred milliseconds while a burst drains.
MAX_POP = 10_000
# The same for a partition whose last due payloads had to be read back from the log. Such a read
# is a pass over the partition's log from the first offset wanted (on noida-db, each fetch returns
# the rest of the partition), whatever the number of records it wants: 10,000 random entries a
# pass made the payload-cache-at-10% bench three times slower than 100,000 (docs/benchmarks.md).
MAX_POP_FROM_LOG = 100_000
# A tracker whose next snapshot segment failed to load reports a due entry it cannot pop yet; wait
# this long for its retry rather than spin.
STALL_WAIT_MS = 50


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
        catch_up: CatchUp | None = None,
        origins: Origins | None = None,
    ) -> None:
        self._catch_up = catch_up
        self._payloads = payloads
        self._metrics = metrics
        self._due_reader = due
        self._deliver = deliver
        self._clock = clock
        self._held = HeldPayloads()
        self._fetch = PayloadFetch(self._held, payloads, metrics, origins)
        self._ahead = ReadAhead(ahead, self._fetch, self._held, clock, read_ahead_ms, catch_up)
        self._stalled_until_ms = 0
        self._from_log: set[TopicPartitionKey] = set()
        """Partitions whose last read of due payloads went to the log: they pop MAX_POP_FROM_LOG."""

    @property
    def read_ahead_ms(self) -> int:
        return self._ahead.window_ms

    # ----------------------------------------------------------------- what the loop asks

    def keep_payload(self, partition: TopicPartitionKey, offset: int, record: Message) -> bool:
        """A delayed record due within the read-ahead window: keep it so it need not be read back.

        False when the memory is full: the caller may put it in the payload cache instead.
        """
        return self._held.keep(partition, offset, record)

    def next_wake_ms(
        self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker], gates: Gates | None = None
    ) -> int | None:
        """When the loop must run next: now while reading ahead, else the next delivery or read-ahead.
        An entry held by its partition's gate waits for intake, which wakes the loop anyway."""
        if self._ahead.reading:
            return 0
        gates = gates or {}
        now = self._clock.now_ms()
        times = [
            t
            for partition, tracker in trackers.items()
            if (t := tracker.next_delivery_time()) is not None
            and not (t <= now and (gate := gates.get(partition)) is not None and t > gate)
        ]
        if not times:
            return None
        if self.read_ahead_ms > 0:
            times.append(self._ahead.wake_ms(min(times)))
        return max(min(times), self._stalled_until_ms)

    def forget(self, partition: TopicPartitionKey) -> None:
        """The partition was revoked: drop what was read ahead for it."""
        self._ahead.forget(partition)
        self._from_log.discard(partition)
        self._held.drop(partition)

    # ----------------------------------------------------------------- one turn of the loop

    def turn(
        self,
        trackers: dict[TopicPartitionKey, DelayedDeliveryTracker],
        read_ahead: bool = True,
        gates: Gates | None = None,
    ) -> None:
        """Deliver what is due; then, unless told not to, spend a slice of time reading ahead."""
        self._held.recount()
        self._deliver_due(trackers, gates or {})
        if read_ahead:
            self._ahead.turn(trackers)

    def _deliver_due(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker], gates: Gates) -> None:
        """Pop every due partition first, so what is not read ahead is fetched in one read for all."""
        popped: dict[TopicPartitionKey, list[Due]] = {}
        missing: dict[TopicPartitionKey, list[Due]] = {}
        cache = self._held.by_partition
        catch_up = self._catch_up
        for partition, tracker in trackers.items():
            if catch_up is not None and not self._ahead.has_looked(partition) and catch_up.first_read(partition):
                continue  # its first payloads are on their way; popping now would read them again
            gate = gates.get(partition)
            if gate is None:
                if not tracker.has_message_available():
                    continue
            elif (next_time := tracker.next_delivery_time()) is None or next_time > gate:
                continue
            due = tracker.pop_due(MAX_POP_FROM_LOG if partition in self._from_log else MAX_POP, gate)
            if not due:
                self._stalled_until_ms = self._clock.now_ms() + STALL_WAIT_MS
                continue
            popped[partition] = due
            held = cache.get(partition)
            absent = [d for d in due if d[1] not in held] if held else due
            if absent:
                missing[partition] = absent
        if missing:
            # Entries the read-ahead could not see (not yet loaded from the index) are read here;
            # the rest of their cache slots comes along for the next turns.
            after = {partition: popped[partition][-1] for partition in missing}
            self._window_along(trackers, after, missing)
            from_log: set[TopicPartitionKey] = set()
            for partition, found in self._fetch.read(self._due_reader, missing, after, from_log):
                self._held.add(partition, found)
            self._from_log.difference_update(missing)
            self._from_log.update(from_log)
        for partition, due in popped.items():
            held = self._held.of(partition)
            self._deliver(partition, [(at, offset, held.pop(offset)) for at, offset in due])
            self._held.count -= len(due)

    def _window_along(
        self,
        trackers: dict[TopicPartitionKey, DelayedDeliveryTracker],
        after: dict[TopicPartitionKey, Due],
        missing: dict[TopicPartitionKey, list[Due]],
    ) -> None:
        """A partition the read-ahead leaves to a catch-up pass still under way: the read at due time
        also takes what falls due within the read-ahead window, as a read-ahead step would.

        Its entries missing here lie in a segment the first read did not see (loaded as the one
        before it ran out) and the pass has not reached yet. On noida-db that read is a pass over
        the partition whatever it asks for; without this, each turn made another, and the catch-up
        got a slice between two of them (docs/scaling.md)."""
        if self._catch_up is None or self.read_ahead_ms <= 0:
            return
        until = self._clock.now_ms() + self.read_ahead_ms
        room = self._held.room()
        for partition, last in after.items():
            if room <= 0:
                return
            if not self._catch_up.catching_up(partition):
                continue
            upcoming = trackers[partition].peek(last, until, room)
            held = self._held.by_partition.get(partition, {})
            ahead = [d for d in upcoming if d[1] not in held]
            missing[partition] = missing[partition] + ahead  # still in deliver-at order: all after `last`
            room -= len(ahead)

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

    def close(self) -> None:
        self._ahead.close()
