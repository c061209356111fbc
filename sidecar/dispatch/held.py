"""Payloads held in memory for upcoming deliveries, per partition by offset, within one bound.

Intake keeps the records that are near due as it reads them, and the read-ahead reads ahead of due
time; delivery takes them out. The bound, a count, not bytes (a `Message` is about 300 bytes with
100-byte values), stops both: past it, due records are read at due time, and that read adds what
it needs whatever the bound.
"""

from confluent_kafka import Message

from sidecar.partitions import TopicPartitionKey

# Payloads held at most (about 90 MB with 100-byte values). Raising it to 700,000, so that a burst
# of 500,000 was held whole before its due time, did not shorten the burst's drain
# (docs/benchmarks.md, "The burst held whole before its due time").
MAX_CACHED = 300_000


class HeldPayloads:
    def __init__(self) -> None:
        self.by_partition: dict[TopicPartitionKey, dict[int, Message | None]] = {}
        self.count = 0
        """About how many payloads are held: counted again every turn (recount), added to as they come."""

    def room(self) -> int:
        return MAX_CACHED - self.count

    def keep(self, partition: TopicPartitionKey, offset: int, record: Message) -> bool:
        """Hold one record read at intake; False when the bound is reached."""
        if self.count < MAX_CACHED:
            self.of(partition)[offset] = record
            self.count += 1
            return True
        return False

    def of(self, partition: TopicPartitionKey) -> dict[int, Message | None]:
        """The partition's payloads, a new empty map if it has none."""
        held = self.by_partition.get(partition)
        if held is None:
            held = self.by_partition[partition] = {}
        return held

    def add(self, partition: TopicPartitionKey, found: dict[int, Message | None]) -> None:
        self.of(partition).update(found)
        self.count += len(found)

    def drop(self, partition: TopicPartitionKey) -> None:
        self.by_partition.pop(partition, None)
        self.recount()

    def recount(self) -> None:
        self.count = sum(len(held) for held in self.by_partition.values())
