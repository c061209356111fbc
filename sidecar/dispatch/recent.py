"""The inbound records read last, kept in memory for a while: a nack usually comes seconds after
its message went out, and its redelivery then needs no read back from the log.

Intake hands over each slice of a partition whole, so keeping it costs one append per slice, not
per record; the oldest slices go first once the budget is spent. An offset's record never changes
in a Kafka log, so a record found here is the one a read back would return. A partition that goes
to another member is forgotten (its topic may even be deleted and created again).

Memory is counted as each record's value plus RECORD_OVERHEAD: the Python objects of a consumed
record with its key and a header or two (measured with tracemalloc, confluent-kafka 2.x).
"""

from bisect import bisect_left, bisect_right
from collections import deque

from confluent_kafka import Message

from sidecar.partitions import TopicPartitionKey

RECORD_OVERHEAD = 350


class _Kept:
    """One partition's slices in offset order; the oldest leave from the front (`head`)."""

    def __init__(self) -> None:
        self.firsts: list[int] = []
        self.slices: list[list[Message]] = []
        self.head = 0

    def drop_oldest(self) -> None:
        self.slices[self.head] = []  # its records freed now, not when the front is cut off
        self.head += 1
        if self.head > 64 and self.head * 2 > len(self.slices):
            del self.firsts[: self.head], self.slices[: self.head]
            self.head = 0

    def __len__(self) -> int:
        return len(self.slices) - self.head

    def find(self, offset: int) -> Message | None:
        at = bisect_right(self.firsts, offset, lo=self.head) - 1
        if at < self.head:
            return None
        records = self.slices[at]
        i = offset - self.firsts[at]
        if i < len(records) and records[i].offset() == offset:
            return records[i]
        i = bisect_left(records, offset, key=Message.offset)  # gaps: transaction markers, compaction
        return records[i] if i < len(records) and records[i].offset() == offset else None


class RecentRecords:
    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._kept: dict[TopicPartitionKey, _Kept] = {}
        self._age: deque[tuple[TopicPartitionKey, int]] = deque()
        """(partition, bytes) of every slice kept, oldest first."""
        self._bytes = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def keep(self, partition: TopicPartitionKey, records: list[Message]) -> None:
        """A slice of one partition, in offset order, after the ones kept before it."""
        if not records or self._budget <= 0:
            return
        size = sum(map(len, records)) + RECORD_OVERHEAD * len(records)
        if size > self._budget:
            return
        kept = self._kept.get(partition)
        if kept is not None and kept.slices[-1][-1].offset() >= records[0].offset():
            self.forget(partition)  # read again from further back (a seek): start over
            kept = None
        if kept is None:
            kept = self._kept[partition] = _Kept()
        kept.firsts.append(records[0].offset())
        kept.slices.append(records)
        self._age.append((partition, size))
        self._bytes += size
        while self._bytes > self._budget:
            oldest, dropped = self._age.popleft()
            self._bytes -= dropped
            kept = self._kept[oldest]
            kept.drop_oldest()
            if not kept:
                del self._kept[oldest]

    def take(
        self, wanted: dict[TopicPartitionKey, list[int]]
    ) -> tuple[list[tuple[TopicPartitionKey, int, Message]], dict[TopicPartitionKey, list[int]]]:
        """(the wanted records kept here, the offsets to read back from the log)."""
        found: list[tuple[TopicPartitionKey, int, Message]] = []
        missing: dict[TopicPartitionKey, list[int]] = {}
        for partition, offsets in wanted.items():
            kept = self._kept.get(partition)
            if kept is None:
                missing[partition] = offsets
                continue
            rest = []
            for offset in offsets:
                record = kept.find(offset)
                if record is None:
                    rest.append(offset)
                else:
                    found.append((partition, offset, record))
            if rest:
                missing[partition] = rest
        return found, missing

    def forget(self, partition: TopicPartitionKey) -> None:
        """A partition gone to another member."""
        if self._kept.pop(partition, None) is not None:
            self._age = deque(item for item in self._age if item[0] != partition)
            self._bytes = sum(size for _, size in self._age)
