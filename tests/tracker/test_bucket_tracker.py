"""BucketTracker, the composing tracker: Pulsar's tracker test scenarios, with this project's semantics
(strict, durable, at-least-once): ordering, recovery, contains and re-adds, storage faults, metrics."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

from sidecar.clock import ManualClock
from sidecar.errors import ConfigError
from sidecar.tracker.base import Due
from sidecar.tracker.storage import FakeSnapshotStorage

from .conftest import drain, make_tracker

# -- ordering and strictness -------------------------------------------------------------------


def test_out_of_order_adds_come_out_in_due_order(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage)
    now = clock.now_ms()
    delays = [500, 30, 200, 10, 400, 10, 90]
    for offset, delay in enumerate(delays):
        assert tracker.add(offset, now + delay)
    assert tracker.next_delivery_time() == now + 10
    assert tracker.pop_due(10) == []
    out = drain(tracker, clock, now + 600)
    assert [d.offset for d in out] == [3, 5, 1, 6, 2, 4, 0]
    assert len(tracker) == 0


def test_due_message_is_refused_at_add(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage)
    assert not tracker.add(1, clock.now_ms())
    assert not tracker.add(2, clock.now_ms() - 5)
    assert not tracker.contains(1)
    assert len(tracker) == 0


def test_a_slice_added_at_once_answers_as_one_add_at_a_time_at_each_edge(
    clock: ManualClock, storage: FakeSnapshotStorage
) -> None:
    """add_many takes a slice in one step only in the common case; at each edge of that case it
    answers, indexes and seals as `add` would."""
    one, many = make_tracker(clock, storage, "orders/1"), make_tracker(clock, FakeSnapshotStorage(), "orders/2")
    now = clock.now_ms()

    def both(offsets: list[int], ats: list[int], deliver_now: bool = True) -> list[int]:
        pairs = enumerate(zip(offsets, ats, strict=True))
        expected = [i for i, (o, a) in pairs if not one.add(o, a, deliver_now=deliver_now)]
        assert many.add_many(offsets, ats, deliver_now=deliver_now) == expected
        assert (len(many), many.next_delivery_time()) == (len(one), one.next_delivery_time())
        assert many.stats().buckets == one.stats().buckets
        return expected

    assert both([0, 1, 2], [now, now + 5, now + 6]) == [0]  # the earliest is due exactly now
    assert both([3, 4], [now + 1, now + 2]) == []
    assert both([2, 3], [now + 7, now + 8]) == []  # replayed offsets: already indexed
    assert both(list(range(5, 17)), [now + 10] * 12) == []  # past min_index_count (10): a seal on the way
    assert many.stats().buckets == 1
    assert one.seal() and many.seal()
    assert both([5, 6], [now + 9, now + 9]) == []  # replayed offsets of a sealed bucket
    assert both([20, 22, 25], [now + 3, now + 3, now + 3]) == []  # offsets with gaps
    assert [many.contains(o) for o in range(19, 27)] == [one.contains(o) for o in range(19, 27)]
    clock.advance(3)
    assert many.pop_due(100) == one.pop_due(100)
    clock.set(now)  # the clock stepped back below the delivered watermark
    assert both([30, 31], [now + 1, now + 2]) == [0, 1]
    clock.set(now + 5)
    assert both([40, 41], [now + 4, now + 6], deliver_now=False) == []  # a keyed partition's: due, yet indexed


def test_equal_deliver_at_keeps_fifo_across_buckets_and_segments(
    clock: ManualClock, storage: FakeSnapshotStorage
) -> None:
    tracker = make_tracker(clock, storage, max_buckets=50)
    at = clock.now_ms() + 100
    for offset in range(60):
        tracker.add(offset, at)
    assert tracker.stats().buckets >= 4
    clock.advance(100)
    assert [d.offset for d in tracker.pop_due(1000)] == list(range(60))


def test_never_before_deliver_at(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage)
    now = clock.now_ms()
    for offset in range(100):
        tracker.add(offset, now + 1 + offset * 3)
    clock.advance(30)
    out = tracker.pop_due(1000)
    assert [d.offset for d in out] == list(range(10))
    assert tracker.next_delivery_time() == now + 31


def test_next_delivery_time_rearmed_after_early_pop_and_re_add(
    clock: ManualClock, storage: FakeSnapshotStorage
) -> None:
    tracker = make_tracker(clock, storage)
    now = clock.now_ms()
    tracker.add(1, now + 100)
    tracker.add(2, now + 200)
    assert tracker.pop_due(10) == []  # an early pop returns nothing and changes nothing
    assert tracker.next_delivery_time() == now + 100
    tracker.add(3, now + 50)
    assert tracker.next_delivery_time() == now + 50
    clock.advance(100)
    assert tracker.pop_due(10) == [Due(now + 50, 3), Due(now + 100, 1)]
    assert tracker.next_delivery_time() == now + 200
    assert tracker.has_message_available() is False


def test_pop_respects_max_messages(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage)
    now = clock.now_ms()
    for offset in range(50):
        tracker.add(offset, now + 10 + offset)
    clock.advance(1000)
    got = []
    while batch := tracker.pop_due(3):
        assert len(batch) <= 3
        got.extend(batch)
    assert [d.offset for d in got] == list(range(50))
    assert tracker.pop_due(0) == []


def test_peek_shows_loaded_upcoming_entries_without_removing_them(
    clock: ManualClock, storage: FakeSnapshotStorage
) -> None:
    tracker = make_tracker(clock, storage, max_buckets=50)
    now = clock.now_ms()
    delays = [300, 100, 500, 50, 100, 20, 40, 60, 80, 90, 95, 30, 35]
    for offset, delay in enumerate(delays):
        tracker.add(offset, now + delay)
    assert tracker.stats().buckets == 1 and tracker.stats().mutable_indexes == 3
    # Bucket 1's first segment (window [now, now + 50)) is loaded: 20, 40; the mutable holds 30, 35, 95.
    assert tracker.peek(None, now + 40, 10) == [
        Due(now + 20, 5),
        Due(now + 30, 11),
        Due(now + 35, 12),
        Due(now + 40, 6),
    ]
    assert tracker.peek(Due(now + 30, 11), now + 40, 2) == [Due(now + 35, 12), Due(now + 40, 6)]
    assert tracker.peek(None, now + 19, 10) == []
    assert len(tracker) == len(delays)
    clock.advance(1000)
    assert tracker.pop_due(100) == sorted(Due(now + d, o) for o, d in enumerate(delays))


# -- recovery ----------------------------------------------------------------------------------


def test_recover_snapshot(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """Pulsar's recover-snapshot test, with this project's answer: nothing lost, nothing twice.

    100 messages due at 10, 20 .. 1000 ms (sealed into buckets), message 1 delivered at 10 ms,
    message 101 added to the mutable bucket, restart at 300 ms: 2..30 come at once, then 31..100
    and 101 in order.
    """
    start = clock.now_ms()
    config: dict[str, Any] = {"min_index_count": 50, "time_step_ms": 100, "max_indexes_per_segment": 5}
    tracker = make_tracker(clock, storage, **config)
    for i in range(1, 101):
        assert tracker.add(i, start + i * 10)
    assert tracker.stats().buckets == 1  # 1..50 sealed when 51 arrived; 51..100 still mutable
    clock.set(start + 10)
    assert tracker.pop_due(100) == [Due(start + 10, 1)]
    tracker.add(101, start + 1010)  # beyond the range: seals 51..100, 101 is in the mutable bucket
    assert tracker.stats().buckets == 2 and tracker.stats().mutable_indexes == 1
    tracker.checkpoint(102)
    clock.set(start + 300)  # crash: no close, no further checkpoint

    recovered = make_tracker(clock, storage, **config)
    assert recovered.index_cursor() == 102
    assert len(recovered) == 100
    assert recovered.contains(101) and recovered.contains(2) and not recovered.contains(1)
    first = recovered.pop_due(1000)
    assert [d.offset for d in first] == list(range(2, 31))
    rest = drain(recovered, clock, start + 1100)
    assert [d.offset for d in rest] == [*range(31, 101), 101]
    assert len(recovered) == 0


def test_recover_without_last_checkpoint_resumes_at_cursor(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """Adds after the last checkpoint are replayed by the caller from index_cursor(), deduped."""
    start = clock.now_ms()
    tracker = make_tracker(clock, storage)
    for i in range(25):
        tracker.add(i, start + 100 + i)
    tracker.checkpoint(25)
    for i in range(25, 40):  # some get sealed (durable early), some stay in memory only
        tracker.add(i, start + 100 + i)
    recovered = make_tracker(clock, storage)
    cursor = recovered.index_cursor()
    assert cursor == 25
    for i in range(cursor, 40):
        assert recovered.add(i, start + 100 + i)  # the replay
    assert len(recovered) == 40
    assert [d.offset for d in drain(recovered, clock, start + 200)] == list(range(40))


def test_popped_but_not_checkpointed_entries_come_back(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """At-least-once: a pop is permanent only at checkpoint, in sealed buckets and the WAL alike."""
    start = clock.now_ms()
    tracker = make_tracker(clock, storage)
    for i in range(35):
        tracker.add(i, start + 10 + i)
    tracker.checkpoint(35)
    clock.advance(20)
    first = tracker.pop_due(1000)
    assert [d.offset for d in first] == list(range(11))
    tracker.checkpoint(35)
    clock.advance(10)
    popped = tracker.pop_due(1000)  # 11..20, never checkpointed
    assert [d.offset for d in popped] == list(range(11, 21))
    tracker.merge()  # a merge must not make those pops durable
    recovered = make_tracker(clock, storage)
    assert len(recovered) == 35 - 11
    again = drain(recovered, clock, start + 100)
    assert [d.offset for d in again] == list(range(11, 35))


def test_recovered_counters_match(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    rng = random.Random(3)
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=3)
    for i in range(300):
        tracker.add(i, start + 1 + rng.randrange(2000))
        if i % 40 == 0:
            clock.advance(50)
            tracker.pop_due(7)
            tracker.checkpoint(i + 1)
    tracker.checkpoint(300)
    before = (len(tracker), tracker.earliest_pending_offset(), tracker.next_delivery_time())
    recovered = make_tracker(clock, storage, max_buckets=3)
    assert (len(recovered), recovered.earliest_pending_offset(), recovered.next_delivery_time()) == before
    assert all(recovered.contains(i) == tracker.contains(i) for i in range(300))


def test_partitions_share_a_storage_independently(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    a = make_tracker(clock, storage, "orders/1")
    b = make_tracker(clock, storage, "orders/10")
    for i in range(40):
        a.add(i, start + 10 + i)
        b.add(i, start + 500 + i)
    a.checkpoint(40)
    b.checkpoint(40)
    b.clear()
    a2 = make_tracker(clock, storage, "orders/1")
    b2 = make_tracker(clock, storage, "orders/10")
    assert len(a2) == 40 and len(b2) == 0 and b2.index_cursor() is None


# -- contains and re-adds ----------------------------------------------------------------------


def test_contains_in_mutable_and_sealed_buckets(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage, max_buckets=50)
    start = clock.now_ms()
    for i in range(0, 60, 2):
        tracker.add(i, start + 100 + i)
    assert tracker.stats().buckets >= 2
    assert all(tracker.contains(i) for i in range(0, 60, 2))
    assert not any(tracker.contains(i) for i in range(1, 60, 2))
    assert not tracker.contains(10_000)
    clock.advance(110)
    popped = {d.offset for d in tracker.pop_due(1000)}
    assert popped == {0, 2, 4, 6, 8, 10}
    assert not any(tracker.contains(i) for i in popped)
    assert tracker.earliest_pending_offset() == 12


def test_re_add_of_indexed_offset_changes_nothing(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage)
    start = clock.now_ms()
    for i in range(30):
        tracker.add(i, start + 100)
    for i in range(30):
        assert tracker.add(i, start + 5)  # a replayed record: already indexed
        assert tracker.add(i, start - 5)  # even with a past deliver-at
    assert len(tracker) == 30
    clock.advance(50)
    assert tracker.pop_due(100) == []


def test_expired_re_add(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """A delivered position re-added in the future is indexed again; in the past it is refused."""
    tracker = make_tracker(clock, storage)
    start = clock.now_ms()
    for i in range(25):
        tracker.add(i, start + 10)
    clock.advance(10)
    assert len(tracker.pop_due(100)) == 25
    assert not tracker.add(3, start)  # already due: deliver now, not indexed
    assert not tracker.contains(3)
    assert tracker.add(4, start + 100)  # re-added (a nack): indexed again
    assert tracker.contains(4)
    tracker.checkpoint(25)
    recovered = make_tracker(clock, storage)
    assert len(recovered) == 1
    clock.advance(90)
    assert recovered.pop_due(100) == [Due(start + 100, 4)]


# -- storage faults ----------------------------------------------------------------------------


def test_fault_on_create_is_retried(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage)
    storage.fail("create", 1)
    start = clock.now_ms()
    for i in range(25):
        tracker.add(i, start + 10 + i)
    assert tracker.stats().buckets == 2 and not tracker.stats().degraded
    assert tracker.stats().ops[("create", "failed")] == 1


def test_fault_on_create_degrades_without_loss(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage, retry_interval_ms=1000)
    storage.fail("create", 100)
    start = clock.now_ms()
    for i in range(40):
        tracker.add(i, start + 100 + i)
    assert tracker.degraded and tracker.stats().degraded_ops == ("create",)
    assert tracker.stats().buckets == 0 and tracker.stats().mutable_indexes == 40
    storage.heal()
    tracker.checkpoint(40)  # retries the seal, then checkpoints
    assert not tracker.stats().degraded and tracker.stats().buckets == 1
    recovered = make_tracker(clock, storage)
    assert [d.offset for d in drain(recovered, clock, start + 200)] == list(range(40))


def test_fault_on_delete_is_retried_at_next_checkpoint(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage)
    for i in range(25):
        tracker.add(i, start + 10 + i)
    clock.advance(100)
    tracker.pop_due(1000)
    storage.fail("delete", 2)
    tracker.checkpoint(25)
    assert tracker.degraded and tracker.stats().buckets == 2
    recovered = make_tracker(clock, storage)
    assert len(recovered) == 0 and recovered.pop_due(100) == []
    tracker.checkpoint(25)
    assert not tracker.stats().degraded and tracker.stats().buckets == 0


def test_fault_on_checkpoint_keeps_cursor(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, min_index_count=1000)
    tracker.add(1, start + 10)
    tracker.checkpoint(2)
    tracker.add(2, start + 20)
    clock.advance(10)
    tracker.pop_due(10)
    storage.fail("checkpoint", 2)
    tracker.checkpoint(3)
    assert tracker.degraded and tracker.index_cursor() == 2  # commit no further than this
    recovered = make_tracker(clock, storage, min_index_count=1000)
    assert recovered.index_cursor() == 2 and len(recovered) == 1  # the un-checkpointed pop is back
    tracker.checkpoint(3)
    assert not tracker.stats().degraded and tracker.index_cursor() == 3
    assert len(make_tracker(clock, storage, min_index_count=1000)) == 1


# -- clear, counters, metrics ------------------------------------------------------------------


def test_counters_do_not_drift_after_clear(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage)
    for i in range(50):
        tracker.add(i, start + 10 + i)
    tracker.checkpoint(50)
    tracker.clear()
    stats = tracker.stats()
    assert (len(tracker), stats.buckets, stats.loaded_indexes, stats.snapshot_bytes) == (0, 0, 0, 0)
    assert tracker.next_delivery_time() is None and tracker.earliest_pending_offset() is None
    assert not tracker.contains(3)
    assert [k for k in storage.stored_keys() if k.startswith(b"porders/0\x00")] == []
    for i in range(50, 80):
        tracker.add(i, start + 10 + i)
    assert len(tracker) == 30
    tracker.checkpoint(80)
    recovered = make_tracker(clock, storage)
    assert len(recovered) == 30
    assert [d.offset for d in drain(recovered, clock, start + 200)] == list(range(50, 80))


def test_clear_with_failing_storage_finishes_later(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage)
    for i in range(30):
        tracker.add(i, start + 10 + i)
    tracker.checkpoint(30)
    storage.fail("clear", 2)
    tracker.clear()
    assert tracker.degraded
    tracker.add(100, start + 50)
    tracker.checkpoint(101)
    assert not tracker.stats().degraded
    recovered = make_tracker(clock, storage)
    assert len(recovered) == 1 and recovered.contains(100)


class Recorder:
    def __init__(self) -> None:
        self.ops: list[tuple[str, bool]] = []

    def on_op(self, op: str, ok: bool, seconds: float) -> None:
        assert seconds >= 0
        self.ops.append((op, ok))


def test_metrics_hooks_and_log_lines(
    clock: ManualClock, storage: FakeSnapshotStorage, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    caplog.set_level(logging.INFO, logger="sidecar.tracker.bucket.tracker")
    tracker = make_tracker(clock, storage, max_buckets=2, listener=recorder)
    start = clock.now_ms()
    for i in range(60):
        tracker.add(i, start + 10 + i)
    storage.fail("checkpoint", 1)
    tracker.checkpoint(60)
    stats = tracker.stats()
    assert stats.buckets == 2 and stats.delayed == 60 and stats.snapshot_bytes > 50 * 16
    assert stats.loaded_indexes <= stats.mutable_indexes + 2 * 4
    assert ("create", True) in recorder.ops and ("merge", True) in recorder.ops
    assert ("checkpoint", False) in recorder.ops and ("checkpoint", True) in recorder.ops
    assert stats.ops[("checkpoint", "failed")] == 1
    assert any("bucket sealed partition=orders/0 bucket=1 entries=10" in r.message for r in caplog.records)
    assert any(r.message.startswith("buckets merged partition=orders/0") for r in caplog.records)


def test_invalid_config_is_rejected(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    with pytest.raises(ConfigError, match="max_buckets"):
        make_tracker(clock, storage, max_buckets=0)


def test_seal_behind_seals_sparse_entries_once_the_cursor_is_far_ahead(
    clock: ManualClock, storage: FakeSnapshotStorage
) -> None:
    """With a state topic, a handoff reads the log again from the mutable bucket's first offset."""
    tracker = make_tracker(clock, storage, min_index_count=1_000, seal_behind=100)
    for offset in (0, 40, 80):
        assert tracker.add(offset, clock.now_ms() + 500)
    tracker.checkpoint(99)
    assert tracker.sealed_layout() == ((), 1, 0), "sealed before the cursor was 100 offsets ahead"
    tracker.checkpoint(100)
    assert tracker.sealed_layout() == ((1,), 2, None)
    assert [d.offset for d in drain(tracker, clock, clock.now_ms() + 600)] == [0, 40, 80]
