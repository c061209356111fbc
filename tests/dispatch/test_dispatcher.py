"""The dispatcher's rules with a controlled clock and a fake log: read ahead, never send early."""

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Message

from sidecar.clock import ManualClock
from sidecar.dispatch import read_ahead
from sidecar.dispatch.dispatcher import MAX_POP, Dispatcher
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.metrics import Metrics
from sidecar.tracker import Due, InMemoryTracker

P = ("orders", 0)


class FakeLog:
    """Offsets map to payloads; a read yields them in offset order, like LogReader."""

    def __init__(self, missing: frozenset[int] = frozenset()) -> None:
        self.reads: list[list[int]] = []
        self.missing = missing

    def read(self, wanted: dict[Any, list[int]]) -> Iterator[tuple[Any, int, Any]]:
        for partition, offsets in wanted.items():
            self.reads.append(sorted(offsets))
            for offset in sorted(offsets):
                yield partition, offset, None if offset in self.missing else f"payload-{offset}"


@pytest.fixture(autouse=True)
def whole_read_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn reads ahead for 10 ms of wall clock at most (the loop's guard, not what these tests
    check): on a loaded CI machine one turn ended after the cache's chunk, before the log was read,
    and a test that counts the reads after one turn failed by chance. Here a turn reads what it starts."""
    monkeypatch.setattr(read_ahead, "READ_SLICE_S", 3600.0)


class Setup:
    def __init__(
        self,
        clock: ManualClock,
        read_ahead_ms: int = 1000,
        missing: frozenset[int] = frozenset(),
        payloads: PayloadCache | None = None,
    ) -> None:
        self.clock = clock
        self.ahead, self.due = FakeLog(missing), FakeLog(missing)
        self.sent: list[tuple[int, int, Any]] = []
        self.tracker = InMemoryTracker(clock)
        self.metrics = Metrics()
        self.dispatcher = Dispatcher(
            self.ahead,
            self.due,
            self.deliver,
            clock,
            read_ahead_ms,
            payloads,
            self.metrics,  # type: ignore[arg-type]
        )

    def reads(self, source: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "delay_sidecar_payload_reads_total", {"topic": P[0], "source": source}
        )

    def deliver(self, partition: Any, due: list[tuple[int, int, Any]]) -> None:
        for deliver_at, offset, record in due:
            assert self.clock.now_ms() >= deliver_at, "sent early"
            self.sent.append((offset, deliver_at, record))

    def add(self, *entries: tuple[int, int]) -> int:
        now = self.clock.now_ms()
        for offset, delay in entries:
            self.tracker.add(offset, now + delay)
        return now

    def turn(self) -> None:
        self.dispatcher.turn({P: self.tracker})


def test_reads_ahead_in_one_pass_and_never_sends_early(clock: ManualClock) -> None:
    s = Setup(clock)
    now = s.add((1, 500), (2, 200), (3, 1500), (4, 900))
    s.turn()
    assert s.ahead.reads == [[1, 2, 4]]  # everything due within the read-ahead window, in one pass
    assert s.sent == [] and len(s.tracker) == 4  # peeked, not popped
    clock.advance(200)
    s.turn()
    assert s.sent == [(2, now + 200, "payload-2")]
    clock.advance(800)
    s.turn()
    assert [x[0] for x in s.sent] == [2, 1, 4]
    assert s.ahead.reads == [[1, 2, 4], [3]]  # 3 came into the window and was read, but is not due
    clock.advance(499)
    s.turn()
    assert [x[0] for x in s.sent] == [2, 1, 4]
    clock.advance(1)
    s.turn()
    assert [x[0] for x in s.sent] == [2, 1, 4, 3]
    assert s.due.reads == []  # nothing had to be read at its due time


def test_kept_payloads_are_not_read_back(clock: ManualClock) -> None:
    s = Setup(clock, read_ahead_ms=0)
    now = s.add((1, 100), (2, 100))
    s.dispatcher.keep_payload(P, 1, "kept")  # type: ignore[arg-type]
    clock.advance(100)
    s.turn()
    assert s.due.reads == [[2]]
    assert s.sent == [(1, now + 100, "kept"), (2, now + 100, "payload-2")]


def test_without_read_ahead_due_records_are_read_when_due(clock: ManualClock) -> None:
    s = Setup(clock, read_ahead_ms=0)
    s.add((5, 10), (3, 10))
    s.turn()
    assert s.ahead.reads == [] and s.sent == []
    clock.advance(10)
    s.turn()
    assert s.due.reads == [[3, 5]] and [x[0] for x in s.sent] == [3, 5]


def test_a_partition_read_back_from_the_log_pops_more_at_a_time(clock: ManualClock) -> None:
    """Each read back from the log is a pass over the partition: after one, the next turn takes up
    to MAX_POP_FROM_LOG entries, so that one pass serves them all."""
    s = Setup(clock, read_ahead_ms=0)
    count = MAX_POP + 2 * MAX_POP
    s.add(*[(offset, 10) for offset in range(count)])
    clock.advance(10)
    s.turn()
    assert len(s.sent) == MAX_POP and len(s.due.reads) == 1
    s.turn()
    assert len(s.sent) == count and len(s.due.reads) == 2
    assert Counter(offset for offset, _, _ in s.sent) == Counter(range(count))


def test_payloads_held_in_memory_keep_the_small_pop(clock: ManualClock) -> None:
    s = Setup(clock, read_ahead_ms=0)
    count = 2 * MAX_POP
    s.add(*[(offset, 10) for offset in range(count)])
    for offset in range(count):
        assert s.dispatcher.keep_payload(P, offset, f"payload-{offset}")  # type: ignore[arg-type]
    clock.advance(10)
    s.turn()
    assert len(s.sent) == MAX_POP and s.due.reads == []


def test_missing_records_are_reported_to_deliver_as_none(clock: ManualClock) -> None:
    s = Setup(clock, missing=frozenset({2}))
    s.add((2, 10))
    clock.advance(10)
    s.turn()
    assert s.sent == [(2, clock.now_ms(), None)]


def test_forgetting_a_revoked_partition_drops_what_was_read_ahead(clock: ManualClock) -> None:
    s = Setup(clock)
    s.add((1, 500))
    s.turn()
    s.dispatcher.forget(P)
    clock.advance(500)
    s.turn()  # a new owner's tracker would pop it; this one still has it, so it is read again
    assert s.due.reads == [[1]] and [x[0] for x in s.sent] == [1]


def test_wake_time_follows_deliveries_and_read_ahead(clock: ManualClock) -> None:
    s = Setup(clock, read_ahead_ms=1000)
    now = clock.now_ms()
    assert s.dispatcher.next_wake_ms({P: s.tracker}) is None
    s.add((1, 5000))
    assert s.dispatcher.next_wake_ms({P: s.tracker}) == now + 4000  # read one window early
    clock.advance(4000)
    s.turn()
    assert s.ahead.reads == [[1]]
    # Read ahead up to +5000 now; look again once that covers less than half a window.
    assert s.dispatcher.next_wake_ms({P: s.tracker}) == now + 4500
    clock.advance(500)
    s.turn()
    assert s.ahead.reads == [[1]]  # nothing new: the peek starts after what was already read


def test_a_window_served_by_the_payload_cache_is_topped_up_at_every_look(clock: ManualClock, tmp_path: Path) -> None:
    """Before: a new pass started only once less than half the window was read ahead, as for the
    log, so the cache's payloads were read half a window at a time (the delayed bench's peaks)."""
    entries = [(offset, 4_000 + offset * 100) for offset in range(1, 30)]  # one every 100 ms from +4.1 s
    s = Setup(clock, read_ahead_ms=1000, payloads=cached(tmp_path, clock, *entries))
    now = s.add(*entries)
    clock.advance(3_200)
    s.turn()
    assert s.dispatcher.next_wake_ms({P: s.tracker}) == now + 3_300  # the next look, not half a window on
    clock.advance(100)
    s.turn()
    assert s.dispatcher.next_wake_ms({P: s.tracker}) == now + 3_400
    assert s.ahead.reads == [] and s.reads("cache") == 3  # +4.1 and +4.2 s, then +4.3 s at the second look


class StalledTracker(InMemoryTracker):
    """A due entry it cannot pop yet, like a bucket tracker whose next segment failed to load."""

    def pop_due(self, max_messages: int, until_ms: int | None = None) -> list[Due]:
        return []


def test_a_stalled_tracker_is_retried_after_a_pause_not_spun_on(clock: ManualClock) -> None:
    s = Setup(clock, read_ahead_ms=0)
    stalled = StalledTracker(clock)
    stalled.add(1, clock.now_ms() + 10)
    clock.advance(10)
    s.dispatcher.turn({P: stalled})
    assert s.dispatcher.next_wake_ms({P: stalled}) == clock.now_ms() + 50


def cached(tmp_path: Path, clock: ManualClock, *entries: tuple[int, int]) -> PayloadCache:
    """A payload cache holding `payload-cached-{offset}` for each (offset, delay)."""
    cache = PayloadCache.open(tmp_path / "cache", owner="test", budget_bytes=1 << 20, horizon_ms=60_000)
    assert cache is not None
    batch = cache.batch(clock.now_ms())
    for offset, delay in entries:
        record = Message(topic=P[0], partition=P[1], offset=offset, value=f"payload-cached-{offset}".encode())
        batch.add(P[0], P[1], offset, clock.now_ms() + delay, record)
    batch.write()
    return cache


def value(record: Any) -> Any:
    return record.value() if isinstance(record, Message) else record


def test_the_payload_cache_is_read_before_the_log(tmp_path: Path, clock: ManualClock) -> None:
    s = Setup(clock, payloads=cached(tmp_path, clock, (1, 500), (2, 200)))
    s.add((1, 500), (2, 200), (3, 900))
    s.turn()
    assert s.ahead.reads == [[3]]  # only the payload the cache does not hold
    clock.advance(900)
    s.turn()
    assert [(offset, value(r)) for offset, _, r in s.sent] == [
        (2, b"payload-cached-2"), (1, b"payload-cached-1"), (3, "payload-3")
    ]  # fmt: skip
    assert (s.reads("cache"), s.reads("log")) == (2, 1)


def test_without_read_ahead_due_payloads_come_from_the_cache(tmp_path: Path, clock: ManualClock) -> None:
    s = Setup(clock, read_ahead_ms=0, payloads=cached(tmp_path, clock, (5, 10)))
    s.add((5, 10), (3, 10))
    clock.advance(10)
    s.turn()
    assert s.due.reads == [[3]]
    assert [(offset, value(r)) for offset, _, r in s.sent] == [(3, "payload-3"), (5, b"payload-cached-5")]


def test_delivered_payloads_are_deleted_after_their_checkpoint(tmp_path: Path, clock: ManualClock) -> None:
    cache = cached(tmp_path, clock, (1, 100), (2, 5000))
    s = Setup(clock, read_ahead_ms=0, payloads=cache)
    s.add((1, 100), (2, 5000))
    clock.advance(1000)
    s.turn()
    full = cache.budget.used
    s.dispatcher.checkpointed({P: s.tracker})
    assert 0 < cache.budget.used < full  # 1 is gone, 2 is pending
    assert s.metrics.registry.get_sample_value("delay_sidecar_payload_cache_bytes") == cache.budget.used
    clock.advance(4000)
    s.turn()
    assert [offset for offset, _, _ in s.sent] == [1, 2] and s.due.reads == []


def test_a_read_at_due_time_brings_the_rest_of_the_slot_along(tmp_path: Path, clock: ManualClock) -> None:
    """Entries the read-ahead cannot see are read when due; the rest of their slot (due in the next
    turns) comes with them, so the slot is scanned once, not once per turn."""
    cache = cached(tmp_path, clock, (1, 10), (2, 20), (3, 30))
    scans: list[dict[Any, Any]] = []
    read = cache.read
    cache.read = lambda wanted, *args: scans.append(wanted) or read(wanted, *args)  # type: ignore[method-assign]
    s = Setup(clock, read_ahead_ms=0, payloads=cache)
    s.add((1, 10), (2, 20), (3, 30))
    s.dispatcher.keep_payload(P, 3, "kept")  # type: ignore[arg-type]  # in memory already: not read again
    for _ in range(3):
        clock.advance(10)
        s.turn()
    assert [(offset, value(r)) for offset, _, r in s.sent] == [
        (1, b"payload-cached-1"),
        (2, b"payload-cached-2"),
        (3, "kept"),
    ]
    assert len(scans) == 1 and s.reads("cache") == 2 and s.due.reads == []
