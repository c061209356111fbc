"""A control partition's pending nacks in the state topic: chunks of accepted records (no Kafka here).

The changelog control/nacks.py keeps is written here in chunks, not a record per nack. A burst of
90,000 nacks cost the checkpoint 90,000 records when they were accepted and 90,000 tombstones
once redelivered, each sent from the loop (0.44 s for the first half); in chunks it is a few dozen
records each time. Keys:

    <control topic>/<partition>/nacks/<seq>        a line per nack: its index offset, a space, its accepted record
    <control topic>/<partition>/nacks/<seq>/dead   the lines of chunk <seq> that no longer count (a roaring bitmap)

A chunk is never rewritten. The lines that stop counting (superseded, or settled and covered by a
commit, the moments control/nacks.py says) go into its dead set, rewritten whole when it changes;
once every line is dead, both records get a tombstone. The manifest names the live chunks, as it
names an inbound partition's buckets (`buckets`, `next_bucket_id`), so a chunk a crashed owner
wrote after its last manifest is never read. Records written before the chunks existed (one
record per nack under `nack/<offset>/<subscription>`) are still read, and rewritten as chunks.

Write order at a checkpoint: new chunks (each with a tombstone for a dead set left under its key
by a crashed owner), the manifest, then dead sets and tombstones, the order the records per nack
had: a restore that sees a manifest sees every chunk it names. Between checkpoints, new chunks
and dead sets may be written without a manifest (`StateTopic.journal`), but no tombstone: the
last manifest may still name the chunk.
"""

from __future__ import annotations

import bisect
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from pyroaring import BitMap

from sidecar.control.commands import AcceptedNack, parse_accepted
from sidecar.control.nacks import Entry
from sidecar.state.image import ImageError, Manifest, PartitionImage, Record
from sidecar.tracker.base import pack

CHUNK_BYTES = 256 * 1024
"""Kafka's default record limit is 1 MB; an accepted record is about 200 bytes."""
EARLY_LINES = 1_000
"""Unwritten nacks of a partition that are written at once, not at the next checkpoint
(`StateTopic.journal`): a checkpoint a second after a burst's start took 50 to 200 ms for them."""
_LAST = sys.maxsize


class _Chunk:
    """Its lines' entries, in line order (sorted): the offsets in an array and the subscriptions
    in a list, 16 bytes a line rather than a tuple's 64 or more (a million long nacks pending)."""

    __slots__ = ("changed", "dead", "offsets", "subs")

    def __init__(self, entries: list[Entry]) -> None:
        self.offsets = array("q", [offset for offset, _ in entries])
        self.subs = [sub for _, sub in entries]
        self.dead = BitMap()
        self.changed = False

    def __len__(self) -> int:
        return len(self.subs)

    def first(self) -> int:
        return self.offsets[0]

    def line(self, entry: Entry) -> int | None:
        offset, sub = entry
        line = bisect.bisect_left(self.offsets, offset)
        while line < len(self.subs) and self.offsets[line] == offset:
            if self.subs[line] == sub:
                return line
            line += 1
        return None


@dataclass
class Restored:
    """What a control partition's image holds: the nacks still pending, by index offset, split by
    whether they are journaled in chunks or in the old one-record-each form (to journal again)."""

    journal: NackJournal
    pending: list[tuple[int, AcceptedNack]]
    legacy: list[tuple[int, AcceptedNack]]


class NackJournal:
    def __init__(self, partition: str, next_seq: int = 1) -> None:
        self.partition = partition
        self._next_seq = next_seq
        self._chunks: dict[int, _Chunk] = {}
        self._firsts: list[tuple[int, int]] = []
        """(first offset, seq) of every live chunk, sorted: where to look for an entry."""
        self._tombstones: list[Record] = []

    def live(self) -> tuple[int, ...]:
        return tuple(sorted(self._chunks))

    def manifest(self, cursor: int) -> Manifest:
        return Manifest(self.live(), self._next_seq, cursor, cursor)

    def write(
        self, pending: list[tuple[Entry, bytes]], dead: Iterable[Entry], manifest: bool = True
    ) -> tuple[list[Record], list[Record]]:
        """(records before the manifest, records after it) for what changed since the last write.

        `pending`: new entries with their accepted record, sorted; `dead`: entries that stopped
        counting. An entry no chunk holds was never journaled, and needs nothing. `manifest`:
        whether a manifest goes between the two lists; without one, a chunk whose every line died
        keeps its records (the last manifest may name it) until a write with one."""
        for entry in dead:
            self.kill(entry)
        before: list[Record] = []
        lines: list[bytes] = []
        entries: list[Entry] = []
        size = 0
        for entry, value in pending:
            lines.append(b"%d %s" % (entry[0], value))
            entries.append(entry)
            size += len(value) + 1
            if size >= CHUNK_BYTES:
                before += self._new_chunk(entries, lines)
                lines, entries, size = [], [], 0
        if entries:
            before += self._new_chunk(entries, lines)
        after: list[Record] = []
        for seq, chunk in list(self._chunks.items()):
            if manifest and len(chunk.dead) == len(chunk):
                del self._chunks[seq]
                self._firsts.remove((chunk.first(), seq))
                after += [(_chunk_key(self.partition, seq), None), (_dead_key(self.partition, seq), None)]
            elif chunk.changed:
                after.append((_dead_key(self.partition, seq), chunk.dead.serialize()))
            chunk.changed = False
        if manifest:
            after += self._tombstones
            self._tombstones = []
        return before, after

    def kill(self, entry: Entry) -> None:
        """`entry` no longer counts: into its chunk's dead set at the next write."""
        at = bisect.bisect_right(self._firsts, (entry[0], _LAST)) - 1
        if at >= 0 and self._mark(self._chunks[self._firsts[at][1]], entry):
            return
        # Chunks overlap only after an entry was journaled twice, or where one offset's
        # subscriptions (a cancel's) span two chunks.
        for chunk in self._chunks.values():
            if self._mark(chunk, entry):
                return

    @staticmethod
    def _mark(chunk: _Chunk, entry: Entry) -> bool:
        line = chunk.line(entry)
        if line is None or line in chunk.dead:
            return False
        chunk.dead.add(line)
        chunk.changed = True
        return True

    def _new_chunk(self, entries: list[Entry], lines: list[bytes]) -> list[Record]:
        seq = self._next_seq
        self._next_seq += 1
        self._add(seq, _Chunk(entries))
        return [(_chunk_key(self.partition, seq), b"\n".join(lines)), (_dead_key(self.partition, seq), None)]

    def _add(self, seq: int, chunk: _Chunk) -> None:
        self._chunks[seq] = chunk
        bisect.insort(self._firsts, (chunk.first(), seq))

    def drop(self, keys: Iterable[bytes]) -> None:
        """Tombstone these records after the next manifest (ones no manifest names any more)."""
        self._tombstones += [(key, None) for key in keys]

    @classmethod
    def restore(cls, image: PartitionImage, manifest: Manifest, through: int) -> Restored:
        """The journal the image holds, with the nacks still pending; ImageError when a chunk the
        manifest names is missing or unreadable. Lines `through` covers (settled before the commit,
        their dead-set update lost with the owner that settled them) and a second copy of a line
        are dead from now on, and records no manifest names are tombstoned."""
        partition = image.partition
        control_topic = partition.rsplit("/", 1)[0]
        journal = cls(partition, _first_free_seq(image))
        pending: dict[Entry, tuple[int, AcceptedNack]] = {}
        for seq in manifest.buckets:
            offsets, nacks = _lines(image.values.get(_chunk_key(partition, seq)), control_topic, seq)
            entries = [(offset, nack.command.subscription) for offset, nack in zip(offsets, nacks, strict=True)]
            if entries != sorted(entries):
                raise ImageError(f"nack chunk {seq} is not in entry order")
            chunk = _Chunk(entries)
            dead = image.values.get(_dead_key(partition, seq))
            if dead is not None:
                try:
                    chunk.dead = BitMap.deserialize(dead)
                except ValueError as exc:
                    raise ImageError(f"the dead set of nack chunk {seq} is unreadable ({exc})") from exc
            journal._add(seq, chunk)
            for line, (entry, nack) in enumerate(zip(entries, nacks, strict=True)):
                if line in chunk.dead:
                    continue
                if pack(nack.deliver_at, entry[0]) <= through or entry in pending:
                    chunk.dead.add(line)
                    chunk.changed = True
                else:
                    pending[entry] = (entry[0], nack)
        legacy = [found for found in _legacy(image) if pack(found[1].deliver_at, found[0]) > through]
        named = {_chunk_key(partition, seq) for seq in manifest.buckets}
        named |= {_dead_key(partition, seq) for seq in manifest.buckets}
        journal.drop(key for key in _journal_keys(image) if key not in named)
        return Restored(journal, sorted(pending.values(), key=lambda found: found[0]), legacy)

    @classmethod
    def unusable(cls, partition: str, image: PartitionImage | None) -> NackJournal:
        """A journal started afresh (the control log is read again instead): its chunks take seqs
        no record in the image uses, and every journal record there goes at the next write.
        (Without an image, a chunk may take the seq of one a crashed owner left; no manifest names
        that one, and its dead set is tombstoned with the new chunk.)"""
        if image is None:
            return cls(partition)
        journal = cls(partition, _first_free_seq(image))
        journal.drop(_journal_keys(image))
        return journal


def _lines(raw: bytes | None, control_topic: str, seq: int) -> tuple[list[int], list[AcceptedNack]]:
    if raw is None:
        raise ImageError(f"nack chunk {seq} is named by the manifest but missing")
    offsets, nacks = [], []
    for line in raw.split(b"\n"):
        number, _, value = line.partition(b" ")
        nack = parse_accepted(value, control_topic)
        if not number.isdigit() or nack is None:
            raise ImageError(f"nack chunk {seq} holds a line that is not an offset and an accepted nack")
        offsets.append(int(number))
        nacks.append(nack)
    return offsets, nacks


def _chunk_key(partition: str, seq: int) -> bytes:
    return f"{partition}/nacks/{seq}".encode()


def _dead_key(partition: str, seq: int) -> bytes:
    return f"{partition}/nacks/{seq}/dead".encode()


def _journal_keys(image: PartitionImage) -> list[bytes]:
    chunks, legacy = f"{image.partition}/nacks/".encode(), f"{image.partition}/nack/".encode()
    return [key for key in image.values if key.startswith(chunks) or key.startswith(legacy)]


def _first_free_seq(image: PartitionImage) -> int:
    """Above every chunk a record or the manifest names."""
    prefix = f"{image.partition}/nacks/".encode()
    seqs = [key[len(prefix) :].split(b"/", 1)[0] for key in image.values if key.startswith(prefix)]
    try:
        manifest = image.manifest()
    except ImageError:
        manifest = None
    named = manifest.next_bucket_id if manifest is not None else 1
    return max(max((int(seq) for seq in seqs if seq.isdigit()), default=0) + 1, named)


def _legacy(image: PartitionImage) -> list[tuple[int, AcceptedNack]]:
    """Nacks written one record each (`nack/<offset>[/<subscription>]`), before chunks."""
    prefix = f"{image.partition}/nack/".encode()
    control_topic = image.partition.rsplit("/", 1)[0]
    found = []
    for key, value in image.values.items():
        if not key.startswith(prefix):
            continue
        number = key[len(prefix) :].split(b"/", 1)[0]
        if not number.isdigit():
            raise ImageError(f"the nack key {key!r} names no offset")
        offset = int(number)
        nack = parse_accepted(value, control_topic)
        if nack is None:
            raise ImageError(f"the accepted nack at control offset {offset} is unreadable")
        found.append((offset, nack))
    return sorted(found, key=lambda pending: pending[0])
