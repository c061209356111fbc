"""A partition restored from the state topic on a new owner: its payloads come from the roll's catch-up
pass, read once, not from reads of the dispatcher's own (each a pass over the partition on noida-db)."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from confluent_kafka import Message

from sidecar.clock import ManualClock
from sidecar.dispatch.dispatcher import Dispatcher
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.dispatch.roll import HorizonRoll
from sidecar.tracker import Due, InMemoryTracker

P = ("orders", 0)


class RestoredTracker(InMemoryTracker):
    """As a bucket tracker just restored: only the first `loaded` offsets are in memory (a bucket's
    first segment), and one bucket spans every offset."""

    def __init__(self, clock: ManualClock, loaded: int) -> None:
        super().__init__(clock)
        self.loaded = loaded

    def peek(self, after: Due | None, until_ms: int, max_messages: int) -> list[Due]:
        return [d for d in super().peek(after, until_ms, max_messages) if d.offset < self.loaded]

    def ranges_due(self, after_ms: int, until_ms: int) -> list[tuple[int, int]]:
        return [(0, 5)]


class FakeLog:
    def __init__(self) -> None:
        self.reads: list[list[int]] = []

    def read(self, wanted: dict[Any, list[int]]) -> Iterator[tuple[Any, int, Message]]:
        for partition, offsets in wanted.items():
            self.reads.append(sorted(offsets))
            for offset in sorted(offsets):
                yield partition, offset, Message(topic=P[0], partition=P[1], offset=offset, value=b"v%d" % offset)


def test_a_restored_partition_is_read_once_by_the_catch_up_and_held_until_its_first_payloads_are_in(
    tmp_path: Path, clock: ManualClock
) -> None:
    now = clock.now_ms()
    due = {0: now + 300, 1: now, 2: now + 100, 3: now + 200, 4: now + 50, 5: now + 400}
    tracker = RestoredTracker(clock, loaded=3)
    for offset, deliver_at in due.items():
        tracker.add(offset, deliver_at, deliver_now=False)
    cache = PayloadCache.open(tmp_path / "cache", owner="test", budget_bytes=1 << 20, horizon_ms=60_000)
    assert cache is not None
    log, ahead, at_due = FakeLog(), FakeLog(), FakeLog()
    roll = HorizonRoll(log, cache, lambda _, record: due[record.offset()], clock)  # type: ignore[arg-type]
    sent: list[tuple[int, int, Any]] = []

    def deliver(partition: Any, records: list[tuple[int, int, Any]]) -> None:
        for deliver_at, offset, record in records:
            assert clock.now_ms() >= deliver_at, "sent early"
            sent.append((offset, deliver_at, record.value()))

    dispatcher = Dispatcher(ahead, at_due, deliver, clock, 1_000, cache, catch_up=roll)  # type: ignore[arg-type]
    roll.adopt(P, below=6)
    trackers = {P: tracker}
    dispatcher.turn(trackers)
    assert sent == []  # offset 1 is due, but its payload is on its way in the catch-up's first read
    while True:
        roll.turn(trackers, dict)
        if not roll.busy:
            break
    assert log.reads == [[0, 1, 2], [0, 1, 2, 3, 4, 5]]  # the index's own entries first, then the buckets
    while len(tracker):
        dispatcher.turn(trackers)
        clock.advance(50)
    assert sent == [(o, due[o], b"v%d" % o) for o in sorted(due, key=due.__getitem__)]
    assert ahead.reads == [] and at_due.reads == []  # nothing read back from the log but by the catch-up


class PassUnderWay:
    """A catch-up pass past its first read, still reading the buckets."""

    def catching_up(self, partition: Any) -> bool:
        return True

    def first_read(self, partition: Any) -> bool:
        return False


def test_a_read_at_due_time_during_the_catch_up_brings_the_read_ahead_window_along(clock: ManualClock) -> None:
    now = clock.now_ms()
    tracker = InMemoryTracker(clock)
    for offset, delay in ((0, 0), (1, 300), (2, 600), (3, 1500)):
        tracker.add(offset, now + delay, deliver_now=False)
    ahead, at_due = FakeLog(), FakeLog()
    sent: list[int] = []
    dispatcher = Dispatcher(
        ahead,  # type: ignore[arg-type]
        at_due,  # type: ignore[arg-type]
        lambda _, records: sent.extend(offset for _, offset, _ in records),
        clock,
        1_000,
        catch_up=PassUnderWay(),
    )
    for _ in range(16):
        dispatcher.turn({P: tracker})
        clock.advance(100)
    assert sent == [0, 1, 2, 3]
    # One read for the window of the first due entry, one for the entry past it: not one per turn.
    assert at_due.reads == [[0, 1, 2], [3]] and ahead.reads == []
