"""The horizon roll: payloads of records delayed beyond the cache horizon, brought in as it reaches them.

Intake caches only what falls due within `--payload-cache-horizon-ms`. A record delayed longer is
indexed by position alone; without more, its payload would be read back from the log when it falls
due, one random read among many. So every ROLL_SHARE of the horizon, the roll takes the stretch of
deliver-at that has just come within the horizon and reads, per partition, the offset ranges of the
index that hold such entries (a sealed bucket is one stretch of the log: one sequential read). It
keeps what falls due in that stretch and is still pending, and writes it to the cache. RocketMQ's
TimerLog roll is the same idea. The partitions of a pass are read side by side, a chunk of each
per read, so a pass costs one fetch stream per partition, not one after the other.

Only records read before the previous roll are considered: later ones were judged at intake with
the horizon already past this stretch, so their payloads are cached, or the budget was full then.
The roll decides nothing: a payload it misses is read back at due time, as without it. It reads a
slice per loop turn, like the read-ahead, so deliveries never wait behind it.

A partition whose index was restored from the state topic has none of its payloads on its new
owner, and gets a catch-up pass of its own at once (`adopt`), in two reads:

1. the first read takes the entries the index holds in memory (the first segment of each bucket:
   those due first) with the deliver-at the index gives them, and caches their payloads;
2. the second reads the buckets through and judges every other pending record again, caching
   those due within the horizon.

Judging a record again costs about five times what reading it does, so the entries due first are
cached after one plain read, not after the whole pass. Meanwhile the dispatcher asks `first_read`
and `catching_up`: it pops nothing from a partition whose first read is under way, and reads
nothing ahead for one whose pass is. On a broker that answers each fetch with the rest of the
partition (noida-db), any read of a partition is a pass over it: a due entry popped during the
first read would cost a pass of its own for what the first read brings a moment later, and
read-ahead steps and the catch-up took turns reading the same records (docs/scaling.md).
Apache Kafka does not need this: it honours max.partition.fetch.bytes, so reading 10 offsets at
the start of a 40 MB partition fetched 1.0 MB in 0.01 to 0.03 s there, against the whole 44 MB in
0.5 to 1.3 s on noida-db; kept for the fallback broker, noida-db.
"""

import logging
import time
from collections.abc import Callable, Generator, Iterable

from confluent_kafka import Message

from sidecar.clock import Clock
from sidecar.dispatch.payload_cache import CacheBatch, PayloadCache
from sidecar.dispatch.reader import LogReader, ReadInterrupted
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker import DelayedDeliveryTracker
from sidecar.tracker.base import pack

logger = logging.getLogger(__name__)

# A roll every this share of the horizon (every minute with the default 10-minute horizon).
ROLL_SHARE = 0.1
READ_SLICE_S = 0.005
# A catch-up pass reads in longer slices: until it is over, its partitions have no payloads, and
# the other partitions wait at most this long for a turn.
CATCH_UP_SLICE_S = 0.05
# Records judged between two cache writes.
WRITE_EVERY = 5_000
# Offsets asked of the log in one read: a bucket can span millions.
READ_CHUNK = 50_000
# Entries a catch-up pass takes from the index's memory for its first read, over all its
# partitions (a dict entry each while the pass runs).
MAX_KNOWN = 200_000

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
        self._slice_s = READ_SLICE_S
        self._catch_up: dict[TopicPartitionKey, int] = {}
        """Partitions whose index came from the state topic, and the offset their log reread starts at."""
        self._catching: set[TopicPartitionKey] = set()
        """Partitions the running catch-up pass has not finished."""
        self._first: set[TopicPartitionKey] = set()
        """Partitions whose first read (the index's own entries) the running catch-up pass has not finished."""

    @property
    def rolled_until(self) -> int:
        """The deliver-at up to which the rolls so far have looked (a roll moves it when it starts)."""
        return self._rolled_until

    @property
    def busy(self) -> bool:
        """A pass is under way: the loop should not sleep between turns."""
        return self._pass is not None

    def adopt(self, partition: TopicPartitionKey, below: int) -> None:
        """A partition restored from the state topic: its new owner has none of its payloads. One
        catch-up pass over its buckets, below the offset where the log is read again (which
        caches what it reads), caches those due within the horizon."""
        self._catch_up[partition] = below

    def catching_up(self, partition: TopicPartitionKey) -> bool:
        """A catch-up pass is bringing the partition's payloads into the cache: from its adoption
        (once no other pass holds the reader and the cache has room) until it has written the last."""
        return partition in self._catching or self._starts(partition)

    def first_read(self, partition: TopicPartitionKey) -> bool:
        """As catching_up, until the pass has written the payloads of the entries due first."""
        return partition in self._first or self._starts(partition)

    def _starts(self, partition: TopicPartitionKey) -> bool:
        """The partition's catch-up starts at the next turn."""
        return partition in self._catch_up and self._pass is None and not self._cache.budget.full

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
                self._catching, self._first = set(ready), set(ready)
                self._slice_s = CATCH_UP_SLICE_S
                self._pass = self._catch_up_pass(trackers, ready, now + self._cache.horizon_ms, now)
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
            self._slice_s = READ_SLICE_S
            self._pass = self._roll(trackers, below, after, until, now)
        deadline = time.monotonic() + self._slice_s
        try:
            for _ in self._pass:
                if time.monotonic() >= deadline:
                    return
        except ReadInterrupted:
            pass
        self._pass = None
        self._catching.clear()
        self._first.clear()

    def forget(self, partition: TopicPartitionKey) -> None:
        self._cursors.pop(partition, None)
        self._catch_up.pop(partition, None)
        self._catching.discard(partition)
        self._first.discard(partition)

    def _catch_up_pass(
        self,
        trackers: dict[TopicPartitionKey, DelayedDeliveryTracker],
        below: dict[TopicPartitionKey, int],
        until: int,
        now: int,
    ) -> Generator[None]:
        """The first read (the index's entries in memory, by offset), then the rest (`_roll`)."""
        started = time.monotonic()
        share = MAX_KNOWN // max(len(below), 1)
        known: dict[TopicPartitionKey, dict[int, int]] = {}
        for partition, cursor in below.items():
            tracker = trackers[partition]
            through = tracker.delivered_through()
            entries = tracker.peek(None, until, share)
            known[partition] = {o: at for at, o in entries if o < cursor and pack(at, o) > through}
        last = {p: max(k) for p, k in known.items() if k}
        self._first &= last.keys()  # nothing to read first for the others
        batch, read, kept = self._cache.batch(now), 0, 0
        for partition, offset, record in self._reader.read({p: list(k) for p, k in known.items() if k}):
            read += 1
            if record is not None:
                batch.add(partition[0], partition[1], offset, known[partition][offset], record)
                kept += 1
            batch = self._written(batch, now, partition, read, last.get(partition) == offset, self._first)
            yield
        batch.write()
        self._first.clear()
        logger.info(
            "payload cache catch-up first read partitions=%d read=%d cached=%d seconds=%.1f",
            len(below),
            read,
            kept,
            time.monotonic() - started,
        )
        yield from self._roll(trackers, below, -1, until, now, known)

    def _roll(
        self,
        trackers: dict[TopicPartitionKey, DelayedDeliveryTracker],
        below: dict[TopicPartitionKey, int],
        after: int,
        until: int,
        now: int,
        known: dict[TopicPartitionKey, dict[int, int]] | None = None,
    ) -> Generator[None]:
        """One pass: yields between records so the caller can stop for the turn. `known`: offsets
        already cached by a catch-up's first read, not judged again."""
        batch = self._cache.batch(now)
        started, judged, kept = time.monotonic(), 0, 0
        known = known or {}
        chunks: dict[TopicPartitionKey, list[list[tuple[int, int]]]] = {}
        for partition, tracker in trackers.items():
            cursor = below.get(partition)
            if cursor is not None:
                spans = _merged((first, min(last, cursor - 1) + 1) for first, last in tracker.ranges_due(after, until))
                if spans:
                    chunks[partition] = _chunks(spans, READ_CHUNK)
        self._catching &= chunks.keys()  # nothing to read for the others
        for i in range(max((len(c) for c in chunks.values()), default=0)):
            wanted = {p: [o for s, e in c[i] for o in range(s, e)] for p, c in chunks.items() if i < len(c)}
            # The last offset of each partition read for the last time: its part of the pass ends there.
            ends = {p: c[i][-1][1] - 1 for p, c in chunks.items() if i == len(c) - 1}
            for partition, offset, record in self._reader.read(wanted):
                tracker = trackers[partition]
                judged += 1
                if record is not None and offset not in known.get(partition, ()) and tracker.contains(offset):
                    at = self._rejudge(partition, record)
                    if at is not None and after < at <= until and pack(at, offset) > tracker.delivered_through():
                        batch.add(partition[0], partition[1], offset, at, record)
                        kept += 1
                batch = self._written(batch, now, partition, judged, ends.get(partition) == offset, self._catching)
                yield
        batch.write()
        if judged:
            logger.info(
                "payload cache roll window_ms=%d-%d read=%d cached=%d seconds=%.1f partitions=%d",
                after,
                until,
                judged,
                kept,
                time.monotonic() - started,
                len(chunks),
            )

    def _written(
        self,
        batch: CacheBatch,
        now: int,
        partition: TopicPartitionKey,
        count: int,
        last: bool,
        pending: set[TopicPartitionKey],
    ) -> CacheBatch:
        """Write the batch every WRITE_EVERY records, and when a partition's part of a read is over:
        only then does it leave `pending`, so that the dispatcher finds its payloads in the cache."""
        if not last and count % WRITE_EVERY:
            return batch
        batch.write()
        if last:
            pending.discard(partition)
        return self._cache.batch(now)


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open offset spans, sorted, empty ones dropped and overlapping ones joined: buckets may
    overlap, and an offset read twice would be cached (and counted against the budget) twice."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[0] < s[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _chunks(spans: list[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """The spans cut into reads of at most `size` offsets each (a read may cover several spans)."""
    out: list[list[tuple[int, int]]] = [[]]
    room = size
    for first, end in spans:
        start = first
        while start < end:
            if room == 0:
                out.append([])
                room = size
            stop = min(end, start + room)
            out[-1].append((start, stop))
            room -= stop - start
            start = stop
    return out
