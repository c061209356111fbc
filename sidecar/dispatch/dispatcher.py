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

A partition restored from the state topic on a new owner has no payloads here; the horizon roll's
catch-up pass (roll.py) brings them into the payload cache. While it runs, the read-ahead leaves
the partition alone, and while its first read runs (the payloads due first), nothing is popped
from it: each would be another read of the same records.
"""

import logging
import time
from collections.abc import Callable, Generator, Mapping
from typing import Protocol

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.dispatch.reader import LogReader, ReadInterrupted
from sidecar.dispatch.trail import Member, TrailReader
from sidecar.metrics import Metrics
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker import DelayedDeliveryTracker, Due
from sidecar.tracker.base import KEY_SHIFT, pack
from sidecar.tracker.runs import Runs

logger = logging.getLogger(__name__)


class Copy(Protocol):
    @property
    def origin(self) -> int:
        """The offset of the message a reschedule copied."""
        ...


Origins = Callable[[TopicPartitionKey], Mapping[int, Copy]]
"""The partition's reschedule copies still indexed, by their offset. A copy's entry is its request
record, which holds no payload: the payload is read from the original."""
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
# Time a turn spends pulling records from the read-ahead before it lets intake and sending run.
READ_SLICE_S = 0.01
# Payloads held for upcoming deliveries (about 300 bytes each with 100-byte values); past this,
# due records are read back when they fall due.
MAX_CACHED = 300_000
# A tracker whose next snapshot segment failed to load reports a due entry it cannot pop yet; wait
# this long for its retry rather than spin.
STALL_WAIT_MS = 50
# Look ahead at most this often, so an idle sidecar with distant entries does not spin. When the
# last pass read payloads from the log, a new pass starts only when what was read ahead covers less
# than half the window: with random delays a pass reads through most of the log, so each pass
# should cover a lot of due time. Payloads from the payload cache are a range scan away, so the
# window is topped up at every look: half a window at once (80,000 payloads at 16,667 due/s) had
# stalled deliveries every 5 s (the delayed bench's p99 peaks).
LOOK_AHEAD_EVERY_MS = 100
# How soon the loop looks again while a run's next members are still being read.
TRAIL_POLL_MS = 20
# Due time looked at per read-ahead step (see _start_read_ahead).
PEEK_STEP_MS = 1_000
# Records read back from the log handed on at a time (the read-ahead checks its time slice between pieces).
LOG_PIECE = 500
# An offset above any real one: the horizon Due(T, SEEN_ALL) says every entry due by T was seen.
SEEN_ALL = (1 << 63) - 1
# Later than any deliver-at (year 9999).
DRAIN_UNTIL_MS = 253_402_300_800_000


class CatchUp(Protocol):
    """The horizon roll's catch-up pass, as the dispatcher sees it (roll.py)."""

    def catching_up(self, partition: TopicPartitionKey) -> bool:
        """Its payloads are being read into the payload cache: reading them ahead would read them twice."""
        ...

    def first_read(self, partition: TopicPartitionKey) -> bool:
        """The payloads of the entries due first are being read: a pop would read them back on its own."""
        ...


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
        trail: TrailReader | None = None,
        catch_up: CatchUp | None = None,
        origins: Origins | None = None,
    ) -> None:
        self._origins = origins
        self._catch_up = catch_up
        self._deferred: set[TopicPartitionKey] = set()
        """Partitions the read-ahead left to a catch-up pass, to look at as soon as it is over."""
        self._trail = trail
        self._payloads = payloads
        self._metrics = metrics
        self._ahead_reader = ahead
        self._due_reader = due
        self._deliver = deliver
        self._clock = clock
        self.read_ahead_ms = read_ahead_ms
        self._cache: dict[TopicPartitionKey, dict[int, Message | None]] = {}
        """Payloads in memory, per partition by offset."""
        self._held = 0
        """About how many payloads `_cache` holds: counted again every turn, and added to by keep_payload."""
        self._horizon: dict[TopicPartitionKey, Due] = {}
        self._read: Generator[tuple[TopicPartitionKey, dict[int, Message | None]]] | None = None
        self._next_look_ms = 0
        self._stalled_until_ms = 0
        self._from_log: set[TopicPartitionKey] = set()
        """Partitions whose last read of due payloads went to the log: they pop MAX_POP_FROM_LOG."""
        self._ahead_from_log: set[TopicPartitionKey] = set()
        """Partitions whose payloads the last read-ahead pass read from the log."""
        self._window_full = True
        """The last read-ahead step reached the end of the window."""

    # ----------------------------------------------------------------- what the loop asks

    def keep_payload(self, partition: TopicPartitionKey, offset: int, record: Message) -> bool:
        """A delayed record due within the read-ahead window: keep it so it need not be read back.

        False when the memory is full: the caller may put it in the payload cache instead.
        """
        if self._held < MAX_CACHED:
            self._held_for(partition)[offset] = record
            self._held += 1
            return True
        return False

    def next_wake_ms(
        self,
        trackers: dict[TopicPartitionKey, DelayedDeliveryTracker],
        runs: dict[TopicPartitionKey, Runs[Message]] | None = None,
    ) -> int | None:
        """When the loop must run next: now while reading ahead, else the next delivery or read-ahead."""
        if self._read is not None:
            return 0
        times = [t for tracker in trackers.values() if (t := tracker.next_delivery_time()) is not None]
        for partition, partition_runs in (runs or {}).items():
            member = self._trail.next_time(partition) if self._trail is not None else None
            if member is not None:
                times.append(member)
            elif partition_runs.pending:
                times.append(self._clock.now_ms() + TRAIL_POLL_MS)  # members to read
        if not times:
            return None
        if self.read_ahead_ms > 0:
            times.append(max(min(times) - self.read_ahead_ms, self._next_look_ms))
        return max(min(times), self._stalled_until_ms)

    def forget(self, partition: TopicPartitionKey) -> None:
        """The partition was revoked: drop what was read ahead for it."""
        self._horizon.pop(partition, None)
        self._deferred.discard(partition)
        self._from_log.discard(partition)
        if self._trail is not None:
            self._trail.forget(partition)
        self._cache.pop(partition, None)
        self._count_held()

    def _count_held(self) -> None:
        self._held = sum(len(held) for held in self._cache.values())

    def _held_for(self, partition: TopicPartitionKey) -> dict[int, Message | None]:
        held = self._cache.get(partition)
        if held is None:
            held = self._cache[partition] = {}
        return held

    # ----------------------------------------------------------------- one turn of the loop

    def turn(
        self,
        trackers: dict[TopicPartitionKey, DelayedDeliveryTracker],
        read_ahead: bool = True,
        runs: dict[TopicPartitionKey, Runs[Message]] | None = None,
    ) -> None:
        """Deliver what is due; then, unless told not to, spend a slice of time reading ahead.

        `runs`: the partitions with pending runs (tracker/runs.py), read back by the trail reader."""
        runs = runs or {}
        self._count_held()
        if self._trail is not None and (runs or self._trail.reading):
            self._trail.fill(runs, self._clock.now_ms())
        self._deliver_due(trackers, runs)
        if not read_ahead:
            return
        if self._deferred and self._catch_up is not None:
            over = {p for p in self._deferred if not self._catch_up.catching_up(p)}
            if over:  # their payloads are in the cache now: read ahead for them without waiting
                self._deferred -= over
                self._next_look_ms = 0
        if self._read is None and self.read_ahead_ms > 0 and self._clock.now_ms() >= self._next_look_ms:
            self._start_read_ahead(trackers)
        if self._read is not None:
            self._continue_read_ahead()

    def _deliver_due(
        self, trackers: dict[TopicPartitionKey, DelayedDeliveryTracker], runs: dict[TopicPartitionKey, Runs[Message]]
    ) -> None:
        """Pop every due partition first, so what is not read ahead is fetched in one read for all."""
        popped: dict[TopicPartitionKey, list[Due]] = {}
        missing: dict[TopicPartitionKey, list[Due]] = {}
        cache = self._cache
        catch_up = self._catch_up
        for partition, tracker in trackers.items():
            if catch_up is not None and partition not in self._horizon and catch_up.first_read(partition):
                continue  # its first payloads are on their way; popping now would read them again
            partition_runs = runs.get(partition)
            if partition_runs:
                due = self._pop_with_runs(partition, tracker, partition_runs)
                if not due:
                    continue
            elif not tracker.has_message_available():
                continue
            else:
                due = tracker.pop_due(MAX_POP_FROM_LOG if partition in self._from_log else MAX_POP)
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
            for partition, found in self._fetch(self._due_reader, missing, after, from_log):
                self._held_for(partition).update(found)
                self._held += len(found)
            self._from_log.difference_update(missing)
            self._from_log.update(from_log)
        for partition, due in popped.items():
            held = self._held_for(partition)
            self._deliver(partition, [(at, offset, held.pop(offset)) for at, offset in due])
            self._held -= len(due)

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
        room = MAX_CACHED - self._held
        for partition, last in after.items():
            if room <= 0:
                return
            if not self._catch_up.catching_up(partition):
                continue
            upcoming = trackers[partition].peek(last, until, room)
            held = self._cache.get(partition, {})
            ahead = [d for d in upcoming if d[1] not in held]
            missing[partition] = missing[partition] + ahead  # still in deliver-at order: all after `last`
            room -= len(ahead)

    def _pop_with_runs(
        self, partition: TopicPartitionKey, tracker: DelayedDeliveryTracker, runs: Runs[Message]
    ) -> list[Due]:
        """Index entries and run members that are due, merged in key order: the delivered watermark
        stays exact. A member's record comes with it (into the cache, where delivery looks)."""
        assert self._trail is not None
        members, held = self._trail.members(partition), self._held_for(partition)
        now = self._clock.now_ms()
        out: list[Due] = []
        taken = 0
        while len(out) < MAX_POP:
            bound = pack(members[0][0], members[0][1]) if members else runs.lower_bound()
            if tracker.has_message_available():
                out += tracker.pop_due(MAX_POP - len(out), below_key=bound)
            if not members or members[0][0] > now:
                break
            # Members up to the next index entry (one that failed to load included) go out in a row.
            head = tracker.next_key()
            limit = head if head is not None else DRAIN_UNTIL_MS << KEY_SHIFT
            last: Member | None = None
            while members and len(out) < MAX_POP:
                member = members[0]
                deliver_at, offset = member[0], member[1]
                if deliver_at > now or (deliver_at << KEY_SHIFT | offset) >= limit:
                    break
                members.popleft()
                held[offset] = member[2]
                out.append(Due(deliver_at, offset))
                member[3].delivered(offset, deliver_at)
                last = member
                taken += 1
            if last is None:
                self._stalled_until_ms = now + STALL_WAIT_MS  # an entry before it waits for its segment
                break
            runs.drop_done()
            tracker.note_delivered(pack(last[0], last[1]))
        self._held += taken
        if taken and self._metrics is not None:
            self._metrics.child(self._metrics.payload_reads, partition[0], "run").inc(taken)
        return out

    def _fetch(
        self,
        reader: LogReader,
        wanted: dict[TopicPartitionKey, list[Due]],
        after: dict[TopicPartitionKey, Due] | None = None,
        from_log: set[TopicPartitionKey] | None = None,
    ) -> Generator[tuple[TopicPartitionKey, dict[int, Message | None]]]:
        """Payloads from the payload cache (one scan in key order), then the rest read back from the
        log, as (partition, {offset: record}) pieces.

        With `after`, the cache may also yield payloads not asked for that fall due after it
        (see PayloadCache.read), as long as memory has room for them. `from_log` gets the
        partitions that the log was read for.
        Counts where each payload came from in payload_reads_total, when the read is over.
        """
        rest: dict[TopicPartitionKey, list[int]]
        cached: dict[str, int] = {}
        logged: dict[str, int] = {}
        copies = self._copies_read_from_originals(wanted)
        try:
            if self._payloads is not None:
                room = MAX_CACHED - self._held if after else 0
                lookup = self._payloads.read(wanted, after, room, self._cache)
                for partition, found in lookup.chunks():
                    yield partition, _as_copies(partition, found, copies) if copies else found
                cached = lookup.hits
                rest = lookup.missing()
            else:
                rest = {partition: [d.offset for d in dues] for partition, dues in wanted.items()}
            if from_log is not None:
                from_log.update(partition for partition, offsets in rest.items() if offsets)
            piece: dict[int, Message | None] = {}
            piece_of: TopicPartitionKey | None = None
            for partition, offset, record in reader.read(rest):
                if partition != piece_of or len(piece) >= LOG_PIECE:
                    if piece_of is not None:
                        yield piece_of, _as_copies(piece_of, piece, copies) if copies else piece
                    piece, piece_of = {}, partition
                if record is not None:
                    logged[partition[0]] = logged.get(partition[0], 0) + 1
                piece[offset] = record
            if piece_of is not None:
                yield piece_of, _as_copies(piece_of, piece, copies) if copies else piece
        finally:
            if self._metrics is not None:
                reads = self._metrics.payload_reads
                for source, counts in (("cache", cached), ("log", logged)):
                    for topic, n in counts.items():
                        self._metrics.child(reads, topic, source).inc(n)

    def _copies_read_from_originals(
        self, wanted: dict[TopicPartitionKey, list[Due]]
    ) -> dict[tuple[TopicPartitionKey, int], list[int]]:
        """Ask for each reschedule copy's original instead (in `wanted`, in place). Returns (partition,
        original) -> the offsets to give what is read back: the copies', and the original's own when
        it was asked for too."""
        renamed: dict[tuple[TopicPartitionKey, int], list[int]] = {}
        if self._origins is None:
            return renamed
        for partition, dues in wanted.items():
            origins = self._origins(partition)
            if not origins or not any(d.offset in origins for d in dues):
                continue
            asked: list[Due] = []
            for due in dues:
                copy = origins.get(due.offset)
                offset = copy.origin if copy is not None else due.offset
                readers = renamed.setdefault((partition, offset), [])
                if not readers:
                    asked.append(Due(due.deliver_at, offset))
                readers.append(due.offset)
            wanted[partition] = asked
        return renamed

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
        """Peek at the next PEEK_STEP_MS of due time per partition and start reading their payloads.

        One step at a time: a peek collects and sorts every entry up to its limit, so a whole
        window at once (170,000 entries at 16,667 due/s) would hold up deliveries for a turn.
        """
        now = self._clock.now_ms()
        until = now + self.read_ahead_ms
        room = MAX_CACHED - self._held
        wanted: dict[TopicPartitionKey, list[Due]] = {}
        more = False
        catch_up = self._catch_up
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
            held = self._cache.get(partition, {})
            absent = [d for d in upcoming if d[1] not in held]
            if absent:
                wanted[partition] = absent
                room -= len(absent)
        if wanted:
            self._ahead_from_log = set()
            self._read = self._fetch(self._ahead_reader, wanted, from_log=self._ahead_from_log)
        self._window_full = not (more and room > 0)
        self._next_look_ms = now + LOOK_AHEAD_EVERY_MS if self._window_full else now  # else the next step, once read
        if self._read is None:
            self._pace_log_passes()

    def _pace_log_passes(self) -> None:
        """After a pass that read payloads from the log, and covers the window, the next starts only
        once what was read ahead covers less than half of it (see LOOK_AHEAD_EVERY_MS)."""
        if self._ahead_from_log and self._window_full:
            covered = min((h.deliver_at for h in self._horizon.values()), default=self._clock.now_ms())
            self._next_look_ms = max(self._next_look_ms, covered - self.read_ahead_ms // 2)

    def _continue_read_ahead(self) -> None:
        assert self._read is not None
        deadline = time.monotonic() + READ_SLICE_S
        try:
            for partition, found in self._read:
                if partition in self._horizon:  # still ours
                    self._held_for(partition).update(found)
                    self._held += len(found)
                if time.monotonic() >= deadline:
                    return
        except ReadInterrupted:
            pass  # stopping; nothing read ahead is needed for correctness
        self._read = None
        self._pace_log_passes()

    def close(self) -> None:
        if self._trail is not None:
            self._trail.close()
        if self._read is not None:
            self._read.close()  # counts what it read
        self._read = None


def _as_copies(
    partition: TopicPartitionKey,
    found: dict[int, Message | None],
    copies: dict[tuple[TopicPartitionKey, int], list[int]],
) -> dict[int, Message | None]:
    """Records read for reschedule copies, under the copies' offsets (and the original's, if asked for)."""
    out: dict[int, Message | None] = {}
    for offset, record in found.items():
        for as_offset in copies.get((partition, offset), (offset,)):
            out[as_offset] = record
    return out
