"""Reading payloads before their entries fall due, a slice of time per loop turn.

Reading a record back costs a fetch, and records with random delays lie all over the log, so
reading them only when they fall due would make every delivery wait for a pass over the log. The
read-ahead therefore peeks at the entries that fall due within its window (without removing them
from the tracker), reads their payloads in one pass, a slice per loop turn, and holds them in
memory (held.py) until delivery takes them. It never pops: reading ahead cannot mean delivering
early.

A partition whose horizon roll's catch-up pass (roll.py) is reading its payloads is left alone
until the pass is over: reading them here would read them twice.
"""

import time
from typing import Protocol

from sidecar.clock import Clock
from sidecar.dispatch.fetch import PayloadFetch, Pieces
from sidecar.dispatch.held import HeldPayloads
from sidecar.dispatch.reader import LogReader, ReadInterrupted
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker import DelayedDeliveryTracker, Due

# Time a turn spends pulling records from the read-ahead before it lets intake and sending run.
READ_SLICE_S = 0.01
# Look ahead at most this often, so an idle sidecar with distant entries does not spin. When the
# last pass read payloads from the log, a new pass starts only when what was read ahead covers less
# than half the window: with random delays a pass reads through most of the log, so each pass
# should cover a lot of due time. Payloads from the payload cache are a range scan away, so the
# window is topped up at every look: half a window at once (80,000 payloads at 16,667 due/s) had
# stalled deliveries every 5 s (the delayed bench's p99 peaks).
LOOK_AHEAD_EVERY_MS = 100
# Due time looked at per read-ahead step (see ReadAhead._start).
PEEK_STEP_MS = 1_000
# An offset above any real one: the horizon Due(T, SEEN_ALL) says every entry due by T was seen.
SEEN_ALL = (1 << 63) - 1


class CatchUp(Protocol):
    """The horizon roll's catch-up pass, as dispatch sees it (roll.py)."""

    def catching_up(self, partition: TopicPartitionKey) -> bool:
        """Its payloads are being read into the payload cache: reading them ahead would read them twice."""
        ...

    def first_read(self, partition: TopicPartitionKey) -> bool:
        """The payloads of the entries due first are being read: a pop would read them back on its own."""
        ...


class ReadAhead:
    def __init__(
        self,
        reader: LogReader,
        fetch: PayloadFetch,
        held: HeldPayloads,
        clock: Clock,
        window_ms: int,
        catch_up: CatchUp | None = None,
    ) -> None:
        self._reader = reader
        self._fetch = fetch
        self._held = held
        self._clock = clock
        self.window_ms = window_ms
        self._catch_up = catch_up
        self._horizon: dict[TopicPartitionKey, Due] = {}
        """Per partition, the last entry seen ahead: the next step peeks after it."""
        self._read: Pieces | None = None
        self.next_look_ms = 0
        self._from_log: set[TopicPartitionKey] = set()
        """Partitions whose payloads the last pass read from the log."""
        self._window_full = True
        """The last step reached the end of the window."""
        self._deferred: set[TopicPartitionKey] = set()
        """Partitions left to a catch-up pass, to look at as soon as it is over."""

    @property
    def reading(self) -> bool:
        return self._read is not None

    def has_looked(self, partition: TopicPartitionKey) -> bool:
        """Whether a step has looked ahead in this partition since it was taken on."""
        return partition in self._horizon

    def wake_ms(self, next_due_ms: int) -> int:
        """When the next look is wanted, given the earliest entry due."""
        return max(next_due_ms - self.window_ms, self.next_look_ms)

    def turn(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker]) -> None:
        """Start a step if one is wanted, then read for a slice of time."""
        if self._deferred and self._catch_up is not None:
            over = {p for p in self._deferred if not self._catch_up.catching_up(p)}
            if over:  # their payloads are in the cache now: read ahead for them without waiting
                self._deferred -= over
                self.next_look_ms = 0
        if self._read is None and self.window_ms > 0 and self._clock.now_ms() >= self.next_look_ms:
            self._start(trackers)
        if self._read is not None:
            self._continue()

    def forget(self, partition: TopicPartitionKey) -> None:
        self._horizon.pop(partition, None)
        self._deferred.discard(partition)

    def close(self) -> None:
        if self._read is not None:
            self._read.close()  # counts what it read
        self._read = None

    def _start(self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker]) -> None:
        """Peek at the next PEEK_STEP_MS of due time per partition and start reading their payloads.

        One step at a time: a peek collects and sorts every entry up to its limit, so a whole
        window at once (170,000 entries at 16,667 due/s) would hold up deliveries for a turn.
        """
        now = self._clock.now_ms()
        until = now + self.window_ms
        room = self._held.room()
        wanted: dict[TopicPartitionKey, list[Due]] = {}
        more = False
        catch_up = self._catch_up
        by_partition = self._held.by_partition
        for partition, tracker in trackers.items():
            next_time = tracker.next_delivery_time()
            if room <= 0 or next_time is None or next_time > until:
                continue
            if catch_up is not None and catch_up.catching_up(partition):
                self._deferred.add(partition)  # the catch-up pass is reading these records already
                continue
            after = self._horizon.get(partition)
            seen = after.deliver_at if after is not None else now
            step = min(until, max(seen, next_time) + PEEK_STEP_MS)
            upcoming = tracker.peek(after, step, room)
            if len(upcoming) >= room:
                self._horizon[partition] = upcoming[-1]
            else:  # everything due by `step` is seen, even where nothing is due
                self._horizon[partition] = Due(step, SEEN_ALL)
            more = more or self._horizon[partition].deliver_at < until
            held = by_partition.get(partition, {})
            absent = [d for d in upcoming if d[1] not in held]
            if absent:
                wanted[partition] = absent
                room -= len(absent)
        if wanted:
            self._from_log = set()
            self._read = self._fetch.read(self._reader, wanted, from_log=self._from_log)
        self._window_full = not (more and room > 0)
        self.next_look_ms = now + LOOK_AHEAD_EVERY_MS if self._window_full else now  # else the next step, once read
        if self._read is None:
            self._pace_log_passes()

    def _pace_log_passes(self) -> None:
        """After a pass that read payloads from the log, and covers the window, the next starts only
        once what was read ahead covers less than half of it (see LOOK_AHEAD_EVERY_MS)."""
        if self._from_log and self._window_full:
            covered = min((h.deliver_at for h in self._horizon.values()), default=self._clock.now_ms())
            self.next_look_ms = max(self.next_look_ms, covered - self.window_ms // 2)

    def _continue(self) -> None:
        assert self._read is not None
        deadline = time.monotonic() + READ_SLICE_S
        try:
            for partition, found in self._read:
                if partition in self._horizon:  # still ours
                    self._held.add(partition, found)
                if time.monotonic() >= deadline:
                    return
        except ReadInterrupted:
            pass  # stopping; nothing read ahead is needed for correctness
        self._read = None
        self._pace_log_passes()
