"""Tracker order and strictness, with a clock the test moves (Pulsar's AbstractDeliveryTrackerTest)."""

from sidecar.clock import ManualClock
from sidecar.tracker import Due, InMemoryTracker


def test_out_of_order_adds_come_out_in_due_order(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    now = clock.now_ms()
    for offset, delay in [(1, 50), (2, 10), (3, 40), (4, 20), (5, 30)]:
        assert tracker.add(offset, now + delay)
    assert len(tracker) == 5
    assert tracker.next_delivery_time() == now + 10
    clock.advance(50)
    assert [d.offset for d in tracker.pop_due(100)] == [2, 4, 5, 3, 1]
    assert len(tracker) == 0


def test_equal_deliver_at_keeps_fifo(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    at = clock.now_ms() + 100
    for offset in (7, 3, 9, 1):
        tracker.add(offset, at)
    clock.advance(100)
    # FIFO is the producer's order, which is offset order within a partition.
    assert tracker.pop_due(10) == [Due(at, 1), Due(at, 3), Due(at, 7), Due(at, 9)]


def test_add_already_due_is_refused_so_it_is_delivered_at_once(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    assert tracker.add(1, clock.now_ms()) is False
    assert tracker.add(2, clock.now_ms() - 1000) is False
    assert len(tracker) == 0 and not tracker.contains(1)


def test_strict_never_before_deliver_at(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    at = clock.now_ms() + 1000
    tracker.add(1, at)
    clock.advance(999)
    assert not tracker.has_message_available()
    assert tracker.pop_due(10) == []
    clock.advance(1)
    assert tracker.has_message_available()
    assert tracker.pop_due(10) == [Due(at, 1)]


def test_pop_respects_max_messages_and_next_time_rearms(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    now = clock.now_ms()
    for offset in range(10):
        tracker.add(offset, now + 10 + offset)
    clock.advance(100)
    assert [d.offset for d in tracker.pop_due(3)] == [0, 1, 2]
    assert tracker.next_delivery_time() == now + 13
    tracker.pop_due(100)
    assert tracker.next_delivery_time() is None
    # After the queue drained, a re-add arms the next delivery time again.
    tracker.add(100, clock.now_ms() + 5)
    assert tracker.next_delivery_time() == clock.now_ms() + 5


def test_readd_is_deduplicated_and_earliest_pending_tracks_the_log(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    now = clock.now_ms()
    tracker.add(5, now + 10)
    tracker.add(8, now + 20)
    assert tracker.add(5, now + 30) is True
    assert len(tracker) == 2 and tracker.contains(5)
    assert tracker.earliest_pending_offset() == 5
    clock.advance(10)
    tracker.pop_due(10)
    assert tracker.earliest_pending_offset() == 8
    clock.advance(10)
    tracker.pop_due(10)
    assert tracker.earliest_pending_offset() is None


def test_peek_shows_upcoming_entries_without_removing_them(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    now = clock.now_ms()
    for offset, delay in [(1, 100), (2, 300), (3, 50), (4, 100), (5, 900)]:
        tracker.add(offset, now + delay)
    assert tracker.peek(None, now + 300, 10) == [
        Due(now + 50, 3),
        Due(now + 100, 1),
        Due(now + 100, 4),
        Due(now + 300, 2),
    ]
    assert tracker.peek(Due(now + 100, 1), now + 300, 10) == [Due(now + 100, 4), Due(now + 300, 2)]
    assert tracker.peek(None, now + 1000, 2) == [Due(now + 50, 3), Due(now + 100, 1)]
    assert len(tracker) == 5 and tracker.pop_due(10) == []


def test_the_delivered_watermark_keeps_every_delivery_in_key_order(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    now = clock.now_ms()
    assert tracker.add(1, now + 100)
    assert not tracker.add(2, now - 5)  # due, nothing indexed before it: delivered now, as if popped
    assert tracker.delivered_through() == (now - 5) << 64 | 2
    clock.advance(200)
    assert tracker.add(3, now + 150)  # due, but behind an indexed entry: it comes out after it
    assert tracker.pop_due(10) == [Due(now + 100, 1), Due(now + 150, 3)]
    assert not tracker.add(4, now + 120)  # at or below the watermark: due by an earlier pop
    assert tracker.delivered_through() == (now + 150) << 64 | 3


def test_drain_pops_entries_before_their_time(clock: ManualClock) -> None:
    tracker = InMemoryTracker(clock)
    tracker.add(1, clock.now_ms() + 10**6)
    assert tracker.pop_due(10) == []
    assert tracker.pop_due(10, until_ms=clock.now_ms() + 10**7) == [Due(clock.now_ms() + 10**6, 1)]
