"""Payloads of index entries: from the payload cache first, then read back from the log.

Both the read-ahead and the read at due time come here. A reschedule copy's entry is its request
record, which holds no payload, so its original is read instead and handed on under the copy's
offset. Where each payload came from is counted in payload_reads_total.
"""

from collections.abc import Callable, Generator, Mapping
from typing import Protocol

from confluent_kafka import Message

from sidecar.dispatch.held import HeldPayloads
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.dispatch.reader import LogReader
from sidecar.metrics import Metrics
from sidecar.partitions import TopicPartitionKey
from sidecar.tracker import Due

# Records read back from the log handed on at a time (the read-ahead checks its time slice between pieces).
LOG_PIECE = 500


class Copy(Protocol):
    @property
    def origin(self) -> int:
        """The offset of the message a reschedule copied."""
        ...


Origins = Callable[[TopicPartitionKey], Mapping[int, Copy]]
"""The partition's reschedule copies still indexed, by their offset. A copy's entry is its request
record, which holds no payload: the payload is read from the original."""
Pieces = Generator[tuple[TopicPartitionKey, dict[int, Message | None]]]
"""(partition, {offset: record}) pieces; record is None when the log no longer has it."""


class PayloadFetch:
    def __init__(
        self,
        held: HeldPayloads,
        payloads: PayloadCache | None = None,
        metrics: Metrics | None = None,
        origins: Origins | None = None,
    ) -> None:
        self._held = held
        self._payloads = payloads
        self._metrics = metrics
        self._origins = origins

    def read(
        self,
        reader: LogReader,
        wanted: dict[TopicPartitionKey, list[Due]],
        after: dict[TopicPartitionKey, Due] | None = None,
        from_log: set[TopicPartitionKey] | None = None,
    ) -> Pieces:
        """Payloads from the payload cache (one scan in key order), then the rest read back from the
        log with `reader`, as (partition, {offset: record}) pieces.

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
                room = self._held.room() if after else 0
                lookup = self._payloads.read(wanted, after, room, self._held.by_partition)
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
