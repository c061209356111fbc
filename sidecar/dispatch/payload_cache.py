"""A local copy of delayed payloads, in delivery order, so delivery is a sequential scan.

Records with random delays that fall due in any window lie all over the inbound log, so reading
them back from Kafka means reading through most of the log for every window. The sidecar has every
payload in hand at intake, so it keeps the payloads of records due within a horizon in a RocksDB of
its own (`--state-dir/cache`), in (deliver-at, topic, partition, offset) order: the payloads of
the next window are then one range scan.

One entry holds the payloads of one partition due in one slot of SLOT_MS from one intake batch,
keyed (slot, topic, partition, first offset). Per-record entries cost about 2 µs more per record
at intake (a skiplist insert and a put each) and more to read back, measured; a slot is small
enough that a read seldom decodes payloads it did not ask for.

The cache decides nothing. The tracker still indexes every position and decides when it is due;
the inbound topic is still the ledger. A payload that is not here, for whatever reason (beyond the
horizon, over the budget, the cache dropped, lost or corrupt), is read back from the log exactly as
without a cache. That is why it may be deleted at any time and why it is written without a
write-ahead log: after a crash it is dropped whole at the next start, rather than trusted.

Disk use is bounded by counting bytes (key + value of every entry, before compression) per second
of deliver-at; past the budget new payloads are not cached until delivered ones are deleted.
"""

from __future__ import annotations

import bisect
import logging
import marshal
import struct
from collections.abc import Container, Iterator, Mapping
from pathlib import Path

import rocksdict
from confluent_kafka import Message

from sidecar.dispatch.cache_store import META_CLEAN, close_quietly, one_line, open_store
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker.base import Due

logger = logging.getLogger(__name__)

Entry = tuple[int, int, int, int, bytes | None, bytes | None, list[tuple[str, bytes | None]] | None]
"""(deliver_at, offset, timestamp type, timestamp, key, value, headers): what delivery uses."""

# Bumped when the key or value layout changes; marshal's own version is part of it, since marshal
# output is only promised to be readable by the same format version.
FORMAT = f"2/marshal{marshal.version}".encode()
DATA = b"d"
MAX_DELIVER_AT = (1 << 64) - 1
# Deliver-at time covered by one entry. It divides a second, so deleting whole seconds deletes
# whole entries and the byte count per second stays exact.
SLOT_MS = 100
# Caching resumes once deletions bring the counted bytes back under this share of the budget, so a
# cache at its limit does not flap between full and not full on every checkpoint.
RESUME_AT = 0.9
# Payloads looked up per pass: a chunk of whole slots takes a few milliseconds to read.
CHUNK = 2_000

_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")


def encode_key(deliver_at: int, topic: str, partition: int, offset: int) -> bytes:
    """Sorts as (deliver-at, topic, partition, offset): fixed-width big-endian numbers, and a NUL
    after the topic (Kafka topic names never hold one), so a shorter name sorts first."""
    return DATA + _U64.pack(deliver_at) + partition_infix(topic, partition) + _U64.pack(offset)


def partition_infix(topic: str, partition: int) -> bytes:
    return topic.encode() + b"\0" + _U32.pack(partition)


def decode_key(key: bytes) -> tuple[int, str, int, int]:
    """(deliver_at, topic, partition, offset); for tests and debugging only."""
    (deliver_at,) = _U64.unpack_from(key, 1)
    end = key.index(b"\0", 9)
    (partition,) = _U32.unpack_from(key, end + 1)
    (offset,) = _U64.unpack_from(key, end + 5)
    return deliver_at, key[9:end].decode(), partition, offset


def time_key(deliver_at: int) -> bytes:
    """The first key at `deliver_at`: range scans and deletions start or end here."""
    return DATA + _U64.pack(deliver_at)


def entry(deliver_at: int, record: Message, headers: list[tuple[str, bytes | None]] | None) -> Entry:
    kind, stamp = record.timestamp()
    return (deliver_at, record.offset(), kind, stamp, record.key(), record.value(), headers)


def to_message(topic: str, partition: int, e: Entry) -> Message:
    """The record as delivery and dead-lettering read it.

    Positional (topic, partition, offset, key, value, headers, error, timestamp): a third of the
    keyword form's cost, 0.22 against 0.68 µs here, paid for every cached payload delivered."""
    _, offset, kind, stamp, key, value, headers = e
    return Message(topic, partition, offset, key, value, headers, None, (kind, stamp))


class ByteBudget:
    """Bytes cached per second of deliver-at, so deleting everything due before a time frees a known amount."""

    def __init__(self, budget: int, by_second: dict[int, int] | None = None) -> None:
        self.budget = budget
        self.by_second: dict[int, int] = dict(by_second or {})
        self.used = sum(self.by_second.values())
        self.full = False

    def take(self, deliver_at: int, size: int) -> bool:
        """Count `size` bytes due at `deliver_at`; False (and nothing counted) when over the budget."""
        if self.full:
            return False
        if self.used + size > self.budget:
            self.full = True
            logger.warning(
                "payload cache full; payloads are read back from the log until delivered ones are deleted "
                "used_bytes=%d budget_bytes=%d (raise --payload-cache-bytes for more)",
                self.used,
                self.budget,
            )
            return False
        second = deliver_at // 1000
        self.by_second[second] = self.by_second.get(second, 0) + size
        self.used += size
        return True

    def release_before(self, second: int) -> int:
        """Forget the bytes of every second before `second`; returns how many were freed."""
        freed = 0
        for s in [s for s in self.by_second if s < second]:
            freed += self.by_second.pop(s)
        self.used -= freed
        if self.full and self.used <= self.budget * RESUME_AT:
            self.full = False
            logger.info("payload cache has room again used_bytes=%d budget_bytes=%d", self.used, self.budget)
        return freed


class CacheBatch:
    """The payloads of one intake batch, grouped by partition and slot, written in one WriteBatch.

    This runs for every delayed record at intake: per record it only appends a tuple; the
    serialising, counting and writing is done per group in `write()`.
    """

    def __init__(self, cache: PayloadCache, now_ms: int) -> None:
        self._cache = cache
        self._until = now_ms + cache.horizon_ms
        self._budget = cache.budget
        self._groups: dict[tuple[str, int, int], list[Entry]] = {}

    def add(self, topic: str, partition: int, offset: int, deliver_at: int, record: Message) -> None:
        """Cache the payload of an indexed record, if it falls due within the horizon (and, at
        `write()`, fits the budget)."""
        self.add_many(topic, partition, [(offset, deliver_at, record)])

    def add_many(self, topic: str, partition: int, records: list[tuple[int, int, Message]]) -> None:
        """`add` of each indexed (offset, deliver-at, record) of one partition, with the record's own headers."""
        if self._budget.full:
            return
        until, groups = self._until, self._groups
        for offset, deliver_at, record in records:
            if deliver_at > until or deliver_at < 0:
                continue
            slot = (topic, partition, deliver_at // SLOT_MS)
            group = groups.get(slot)
            if group is None:
                group = groups[slot] = []
            kind, stamp = record.timestamp()
            group.append((deliver_at, offset, kind, stamp, record.key(), record.value(), record.headers()))

    @property
    def count(self) -> int:
        return sum(len(g) for g in self._groups.values())

    @property
    def entries(self) -> int:
        """The RocksDB entries `write()` makes: one per partition and slot (bench/cache_cost.py)."""
        return len(self._groups)

    def write(self) -> None:
        if not self._groups:
            return
        batch = rocksdict.WriteBatch(raw_mode=True)
        budget = self._budget
        written = 0
        for (topic, partition, slot), group in self._groups.items():
            key = encode_key(slot * SLOT_MS, topic, partition, group[0][1])
            value = marshal.dumps(group)
            if not budget.take(slot * SLOT_MS, len(key) + len(value)):
                break
            batch.put(key, value)
            written += 1
        if written:
            self._cache._write(batch)


class CacheRead:
    """One lookup of many payloads: iterate for the hits, then ask for the misses.

    The wanted entries are taken in chunks of whole slots, about CHUNK entries each, earliest
    deliver-at first across all partitions: a read-ahead pass of a whole window never blocks the
    loop for longer than a chunk, and the payloads due first are found first. A chunk's hits come
    as one dictionary per partition, offset to record: a burst reads hundreds of thousands, and a
    generator step per payload through the dispatcher's layers cost more than the read.
    """

    def __init__(
        self,
        cache: PayloadCache,
        wanted: dict[TopicPartitionKey, list[Due]],
        after: dict[TopicPartitionKey, Due] | None = None,
        room: int = 0,
        known: Mapping[TopicPartitionKey, Container[int]] | None = None,
    ) -> None:
        self._cache = cache
        self._all = wanted
        self._after = after or {}
        self._room = room
        self._known = known or {}
        self._missing: dict[TopicPartitionKey, list[int]] = {}
        self._partitions = {partition_infix(*p): p for p in wanted}
        self.hits: dict[str, int] = {}
        """Payloads found, per topic."""

    def chunks(self) -> Iterator[tuple[TopicPartitionKey, dict[int, Message]]]:
        """(partition, {offset: record}) per partition and chunk, in chunk order."""
        for chunk in _chunks(self._all, CHUNK):
            yield from self._read_chunk(chunk).items()

    def __iter__(self) -> Iterator[tuple[TopicPartitionKey, int, Message]]:
        for partition, found in self.chunks():
            for offset, record in found.items():
                yield partition, offset, record

    def _read_chunk(self, chunk: dict[TopicPartitionKey, list[Due]]) -> dict[TopicPartitionKey, dict[int, Message]]:
        wanted: dict[TopicPartitionKey, dict[int, int]] = {}
        slots: set[int] = set()
        for partition, asked in chunk.items():
            dues = asked
            if dues[0][0] < 0 or dues[-1][0] >= MAX_DELIVER_AT:  # in deliver-at order: only ends can be out of range
                self._missing.setdefault(partition, []).extend(o for d, o in dues if not 0 <= d < MAX_DELIVER_AT)
                dues = [d for d in dues if 0 <= d[0] < MAX_DELIVER_AT]
            wanted[partition] = {offset: deliver_at for deliver_at, offset in dues}
            slots.update({deliver_at // SLOT_MS for deliver_at, _ in dues})
        found: dict[TopicPartitionKey, dict[int, Message]] = {}
        if slots and not self._cache.closed:
            try:
                self._scan(wanted, sorted(slots), found)
            except Exception as exc:  # a failing cache is a miss, never a failure
                self._cache._failed("read", exc)
        for partition, rest in wanted.items():
            if rest:
                self._missing.setdefault(partition, []).extend(rest)
        return found

    def _scan(
        self,
        wanted: dict[TopicPartitionKey, dict[int, int]],
        slots: list[int],
        found: dict[TopicPartitionKey, dict[int, Message]],
    ) -> None:
        """Read the wanted slots in key order, with one iterator that seeks only over gaps; only the
        entries of wanted partitions are decoded. What is found is taken out of `wanted`."""
        options = rocksdict.ReadOptions()
        options.set_iterate_upper_bound(time_key((slots[-1] + 1) * SLOT_MS))
        options.fill_cache(False)  # type: ignore[call-arg]  # read once, then deleted: caching would only hold memory
        it = self._cache._db.iter(options)
        it.seek(time_key(slots[0] * SLOT_MS))
        partitions, hits, known = self._partitions, self.hits, self._known
        left = sum(len(offsets) for offsets in wanted.values())
        for slot in slots:
            start, end = time_key(slot * SLOT_MS), time_key((slot + 1) * SLOT_MS)
            if it.valid() and it.key() < start:
                it.seek(start)
            while it.valid():
                key = it.key()
                if key >= end:
                    break
                partition = partitions.get(key[9:-8])
                if partition is not None:
                    try:
                        group: list[Entry] = marshal.loads(it.value())
                    except (ValueError, EOFError, TypeError) as exc:
                        self._cache._failed("decode", exc)
                        group = []
                    asked = wanted.get(partition, {})
                    out = found.get(partition)
                    if out is None:
                        out = found[partition] = {}
                    after, held = self._after.get(partition), known.get(partition, ())
                    topic, number = partition
                    before = len(out)
                    for deliver_at, offset, kind, stamp, k, value, headers in group:
                        if asked.get(offset) == deliver_at:  # the deliver-at too: never another record's payload
                            del asked[offset]
                            left -= 1
                        elif after is None or self._room <= 0 or (deliver_at, offset) <= after or offset in held:
                            continue
                        else:
                            self._room -= 1  # not asked for, but due after `after`: found too
                        # to_message, inlined: this runs once per payload of a burst
                        out[offset] = Message(topic, number, offset, k, value, headers, None, (kind, stamp))
                    hits[topic] = hits.get(topic, 0) + len(out) - before
                it.next()
            if not left:
                return

    def missing(self) -> dict[TopicPartitionKey, list[int]]:
        """Offsets, per partition, that the iteration did not yield: to be read back from the log."""
        return self._missing


def _chunks(wanted: dict[TopicPartitionKey, list[Due]], size: int) -> Iterator[dict[TopicPartitionKey, list[Due]]]:
    """Split per-partition lists (each in deliver-at order) into chunks of about `size` entries,
    cut at slot boundaries so that each chunk is one range of whole slots, earliest first."""
    cursors = {partition: 0 for partition, dues in wanted.items() if dues}
    step = max(size // max(len(cursors), 1), 1)
    while cursors:
        bound = min(wanted[p][min(i + step, len(wanted[p])) - 1].deliver_at for p, i in cursors.items())
        bound = (bound // SLOT_MS + 1) * SLOT_MS - 1  # the end of its slot
        chunk: dict[TopicPartitionKey, list[Due]] = {}
        for partition, i in list(cursors.items()):
            dues = wanted[partition]
            j = bisect.bisect_right(dues, (bound, MAX_DELIVER_AT), i)
            if j > i:
                chunk[partition] = dues[i:j]
            if j >= len(dues):
                del cursors[partition]
            else:
                cursors[partition] = j
        yield chunk


class PayloadCache:
    """The cache of one state dir, shared by every partition this sidecar serves.

    Open it with `open()`, which never fails: a cache that cannot be opened, was written by another
    owner or by a process that crashed is dropped and started empty; a cache that cannot be created
    at all leaves the sidecar running without one.
    """

    def __init__(self, path: Path, db: rocksdict.Rdict, budget: ByteBudget, horizon_ms: int) -> None:
        self.path = path
        self._db = db
        self.budget = budget
        self.horizon_ms = horizon_ms
        self.closed = False
        self._write_options = rocksdict.WriteOptions()
        # Rebuildable, and dropped after a crash anyway. (The stub types this property as a method.)
        self._write_options.disable_wal = True  # type: ignore[method-assign,assignment]
        self._reported: set[str] = set()

    # ----------------------------------------------------------------- opening and closing

    @classmethod
    def open(cls, path: Path, *, owner: str, budget_bytes: int, horizon_ms: int) -> PayloadCache | None:
        if budget_bytes <= 0:
            return None
        opened = open_store(path, owner, FORMAT)
        if opened is None:
            return None
        db, counts = opened
        cache = cls(path, db, ByteBudget(budget_bytes, counts), horizon_ms)
        logger.info(
            "payload cache open path=%s used_bytes=%d budget_bytes=%d horizon_ms=%d",
            path,
            cache.budget.used,
            budget_bytes,
            horizon_ms,
        )
        return cache

    def close(self) -> None:
        """Flush, then mark the cache clean with its byte counts: the next start may trust it."""
        if self.closed:
            return
        self.closed = True
        try:
            self._db.flush()
            synced = rocksdict.WriteOptions()
            synced.sync = True
            self._db.put(META_CLEAN, marshal.dumps(self.budget.by_second), synced)
        except Exception as exc:  # the next start drops it: only timing is lost
            logger.warning("payload cache not closed cleanly; it is dropped at the next start error=%s", exc)
        close_quietly(self._db)

    # ----------------------------------------------------------------- the three operations

    def batch(self, now_ms: int) -> CacheBatch:
        """Collect the payloads of one intake batch; `write()` it at the end of the batch."""
        return CacheBatch(self, now_ms)

    def read(
        self,
        wanted: dict[TopicPartitionKey, list[Due]],
        after: dict[TopicPartitionKey, Due] | None = None,
        room: int = 0,
        known: Mapping[TopicPartitionKey, Container[int]] | None = None,
    ) -> CacheRead:
        """Payloads of the wanted entries, found by one scan in key order; see CacheRead.

        With `after`, up to `room` payloads of the same entries that were not asked for but are
        due after `after[partition]` are yielded too (unless `known`: already in memory): a read at
        due time gets the rest of its slots, which fall due in the next turns, instead of decoding
        the same slots again then."""
        return CacheRead(self, wanted, after, room, known)

    def delete_before(self, deliver_at: int) -> None:
        """Delete every entry due before the second of `deliver_at` (whole seconds, so the byte count
        stays exact). The caller makes sure these are delivered and checkpointed."""
        if self.closed or deliver_at <= 0:
            return
        second = min(deliver_at, MAX_DELIVER_AT) // 1000
        if not any(s < second for s in self.budget.by_second):
            return
        try:
            self._db.delete_range(time_key(0), time_key(second * 1000), self._write_options)
        except Exception as exc:
            self._failed("delete", exc)
            return
        self.budget.release_before(second)

    def _write(self, batch: rocksdict.WriteBatch) -> None:
        if self.closed:
            return
        try:
            self._db.write(batch, self._write_options)
        except Exception as exc:  # not cached: read back from the log when due
            self._failed("write", exc)

    def _failed(self, operation: str, exc: Exception) -> None:
        """Log a failing operation once; every failure only means a payload read back from the log."""
        if operation not in self._reported:
            self._reported.add(operation)
            logger.warning(
                "payload cache %s failed; affected payloads are read back from the log path=%s error=%s "
                "(check free disk space; deleting the cache directory while stopped is safe)",
                operation,
                self.path,
                one_line(exc),
            )
