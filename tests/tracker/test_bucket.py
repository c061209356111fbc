"""Scenarios of Pulsar's tracker tests, with this project's semantics (strict, durable, at-least-once)."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import pytest

from sidecar.clock import ManualClock
from sidecar.errors import ConfigError
from sidecar.tracker.base import Due
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.memory import InMemoryTracker
from sidecar.tracker.storage import FakeSnapshotStorage

from .conftest import make_tracker


def drain(tracker: BucketTracker | InMemoryTracker, clock: ManualClock, until: int, step: int = 7) -> list[Due]:
    """Move time forward in steps up to `until`, popping all that is due; check strictness."""
    out: list[Due] = []
    while True:
        batch = tracker.pop_due(1_000_000)
        for due in batch:
            assert due.deliver_at <= clock.now_ms(), "delivered before its deliver-at"
        out.extend(batch)
        if clock.now_ms() >= until:
            return out
        clock.advance(min(step, until - clock.now_ms()))


def ordered(entries: list[Due]) -> bool:
    return entries == sorted(entries)


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


def test_crash_after_checkpoint_loses_nothing_from_mutable_bucket(
    clock: ManualClock, storage: FakeSnapshotStorage
) -> None:
    tracker = make_tracker(clock, storage, min_index_count=1000)
    start = clock.now_ms()
    for i in range(30):
        tracker.add(i, start + 50 + (i * 37) % 100)
    tracker.checkpoint(30)
    assert tracker.stats().buckets == 0
    recovered = make_tracker(clock, storage, min_index_count=1000)
    assert len(recovered) == 30
    expected = sorted(Due(start + 50 + (i * 37) % 100, i) for i in range(30))
    assert drain(recovered, clock, start + 200) == expected


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


# -- buckets, segments, merges -----------------------------------------------------------------


def test_segments_respect_max_indexes_and_time_step(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage, max_buckets=100, max_indexes_per_segment=4, time_step_ms=50)
    rng = random.Random(7)
    start = clock.now_ms()
    for i in range(200):
        tracker.add(i, start + 1 + rng.randrange(400))
    meta = storage.load_partition("orders/0")
    assert meta is not None and len(meta.bucket_ids) == tracker.stats().buckets > 5
    for bucket_id in meta.bucket_ids:
        bucket, _ = storage.load_bucket("orders/0", bucket_id)
        assert max(bucket.seg_count) <= 4
        for n in range(bucket.segment_count):
            segment = storage.load_segment("orders/0", bucket_id, n)
            assert len(segment) == bucket.seg_count[n]
            assert segment.deliver_at[-1] - segment.deliver_at[0] < 50
            assert list(segment.deliver_at) == sorted(segment.deliver_at)


def test_merge_keeps_every_segment(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """Pulsar #26251: count before restart == count after, and every message is delivered."""
    rng = random.Random(11)
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=2)
    expected = []
    for i in range(400):
        at = start + 1 + rng.randrange(3000)
        tracker.add(i, at)
        expected.append(Due(at, i))
    stats = tracker.stats()
    assert stats.ops.get(("merge", "succeed"), 0) > 10
    assert stats.buckets <= 2
    tracker.checkpoint(400)
    recovered = make_tracker(clock, storage, max_buckets=2)
    assert len(recovered) == len(tracker) == 400
    assert drain(recovered, clock, start + 3001, step=50) == sorted(expected)


@pytest.mark.parametrize("max_buckets", [1, 2, 3])
def test_merge_with_few_max_buckets(clock: ManualClock, storage: FakeSnapshotStorage, max_buckets: int) -> None:
    rng = random.Random(max_buckets)
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=max_buckets)
    model = InMemoryTracker(clock)
    got: list[Due] = []
    want: list[Due] = []
    for i in range(250):
        at = clock.now_ms() + 1 + rng.randrange(500)
        assert tracker.add(i, at) == model.add(i, at)
        assert tracker.stats().buckets <= max_buckets
        if i % 25 == 0:
            clock.advance(rng.randrange(60))
            got += tracker.pop_due(1000)
            want += model.pop_due(1000)
            tracker.checkpoint(i + 1)
    got += drain(tracker, clock, start + 2000)
    want += drain(model, clock, start + 2000)
    assert got == want and len(got) == 250


def test_merge_takes_four_adjacent_buckets_with_fewest_pending(
    clock: ManualClock, storage: FakeSnapshotStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """Pulsar merges up to 4 adjacent buckets, fewest pending first; pops not yet durable survive it."""
    caplog.set_level(logging.INFO, logger="sidecar.tracker.bucket.tracker")
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=50)
    expected = []
    for i in range(60):
        # Buckets 5 and 6 (offsets 40..59) hold the earliest entries: popping them leaves them smaller.
        at = start + 10 + i % 10 if i >= 40 else start + 1000 + i
        tracker.add(i, at)
        expected.append(Due(at, i))
    assert tracker.seal() and tracker.stats().buckets == 6
    tracker.checkpoint(60)
    clock.set(start + 14)
    popped = tracker.pop_due(100)
    assert [d.offset for d in popped] == [40, 50, 41, 51, 42, 52, 43, 53, 44, 54]
    assert tracker.merge()
    meta = storage.load_partition("orders/0")
    assert meta is not None and meta.bucket_ids == [1, 2, 7]
    assert any("buckets=3,4,5,6 into=7 entries=40" in r.message for r in caplog.records)
    assert len(tracker) == 50 and all(tracker.contains(i) == (i % 10 >= 5) for i in range(40, 60))
    # A crash before the next checkpoint: the five pops were not durable, so they come back.
    crashed = make_tracker(clock, storage, max_buckets=50)
    assert len(crashed) == 60
    clock.set(start + 2000)
    assert crashed.pop_due(1000) == sorted(expected)
    clock.set(start + 14)
    tracker.checkpoint(60)
    recovered = make_tracker(clock, storage, max_buckets=50)
    assert len(recovered) == 50
    clock.set(start + 2000)
    assert recovered.pop_due(1000) == sorted(expected)[10:]


def test_merges_over_the_limit_go_four_at_a_time(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=6)
    for i in range(80):
        tracker.add(i, start + 10 + (i * 37) % 500)
    # 7 sealed buckets is one over the limit: one merge of 4 leaves 4, not 6.
    assert tracker.stats().buckets == 4
    assert tracker.stats().ops[("merge", "succeed")] == 1
    tracker.checkpoint(80)
    recovered = make_tracker(clock, storage, max_buckets=6)
    got = drain(recovered, clock, start + 600)
    assert sorted(d.offset for d in got) == list(range(80)) and ordered(got)


def test_merge_reads_sources_in_chunks(
    clock: ManualClock, storage: FakeSnapshotStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge reads a few segments per storage call and cuts a few windows at once; the order and
    the pops must not depend on either."""
    monkeypatch.setattr("sidecar.tracker.bucket.merge._READ_CHUNK", 3)
    monkeypatch.setattr("sidecar.tracker.bucket.merge._CUT_BATCH", 5)
    rng = random.Random(3)
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=3, time_step_ms=10, max_indexes_per_segment=2)
    model = InMemoryTracker(clock)
    got: list[Due] = []
    want: list[Due] = []
    for i in range(400):
        at = clock.now_ms() + 1 + rng.randrange(800)
        assert tracker.add(i, at) == model.add(i, at)
        if i % 30 == 0:
            clock.advance(rng.randrange(40))
            got += tracker.pop_due(1000)
            want += model.pop_due(1000)
            if i % 60 == 0:
                tracker.checkpoint(i + 1)
    assert tracker.stats().ops[("merge", "succeed")] > 10
    got += drain(tracker, clock, start + 2000)
    want += drain(model, clock, start + 2000)
    assert got == want and len(got) == 400


def test_fully_delivered_buckets_are_deleted(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=50)
    for i in range(100):
        tracker.add(i, start + 10 + i)
    assert tracker.stats().buckets == 9
    clock.advance(200)
    assert len(tracker.pop_due(1000)) == 100
    tracker.checkpoint(100)
    assert tracker.stats().buckets == 0
    assert tracker.stats().snapshot_bytes == 0
    prefix_keys = [k for k in storage.stored_keys() if k.startswith(b"porders/0\x00b")]
    assert prefix_keys == []


def test_delivered_segments_are_dropped_from_storage(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, min_index_count=200, max_buckets=50)
    for i in range(201):
        tracker.add(i, start + 10 + i)
    segments_before = len([k for k in storage.stored_keys() if b"s" in k[-5:-4]])
    clock.advance(110)
    tracker.pop_due(1000)
    tracker.checkpoint(201)
    segments_after = len([k for k in storage.stored_keys() if b"s" in k[-5:-4]])
    assert segments_after < segments_before
    recovered = make_tracker(clock, storage, min_index_count=200, max_buckets=50)
    assert len(recovered) == 201 - 101
    assert [d.offset for d in drain(recovered, clock, start + 400)] == list(range(101, 201))


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


def test_re_add_after_pop_before_checkpoint_is_not_duplicated(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=1)
    for i in range(30):
        tracker.add(i, start + 10 + i)
    clock.advance(20)
    popped = tracker.pop_due(1000)
    for due in popped:
        tracker.add(due.offset, start + 500 + due.offset)  # re-added before any checkpoint
    for i in range(30, 60):
        tracker.add(i, start + 100 + i)  # more seals and merges
    tracker.checkpoint(60)
    recovered = make_tracker(clock, storage, max_buckets=1)
    out = drain(recovered, clock, start + 1000)
    assert sorted(d.offset for d in out) == list(range(60))
    assert len(recovered) == 0


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


def test_fault_on_segment_load_never_skips(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """Pulsar #26230: a message whose segment is not loaded is not skipped, nor is anything after it."""
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=50, retry_interval_ms=100)
    for i in range(40):
        tracker.add(i, start + 10 + (i % 10) * 10 + i // 10)  # buckets interleave in time
    tracker.checkpoint(40)
    clock.advance(200)
    storage.fail("load", 10)
    got = tracker.pop_due(1000)
    assert tracker.degraded
    expected = sorted(Due(start + 10 + (i % 10) * 10 + i // 10, i) for i in range(40))
    assert got == expected[: len(got)] and len(got) < 40
    next_time = tracker.next_delivery_time()
    assert next_time is not None and next_time <= clock.now_ms()
    storage.heal()
    assert tracker.pop_due(1000) == []  # waits for the retry interval
    clock.advance(100)
    got += tracker.pop_due(1000)
    assert got == expected
    assert not tracker.stats().degraded


def test_fault_on_segment_load_at_recovery_is_retried(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage)
    for i in range(30):
        tracker.add(i, start + 10 + i)
    tracker.checkpoint(30)
    storage.fail("load", 1)
    recovered = make_tracker(clock, storage)
    assert len(recovered) == 30
    assert [d.offset for d in drain(recovered, clock, start + 100)] == list(range(30))


def test_fault_on_merge_keeps_buckets(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    start = clock.now_ms()
    tracker = make_tracker(clock, storage, max_buckets=2, retry_interval_ms=10_000)
    storage.fail("merge", 2)
    for i in range(45):
        tracker.add(i, start + 10 + i)
    assert tracker.degraded and tracker.stats().buckets == 3
    tracker.checkpoint(45)
    assert not tracker.stats().degraded and tracker.stats().buckets == 2
    recovered = make_tracker(clock, storage, max_buckets=2)
    assert [d.offset for d in drain(recovered, clock, start + 100)] == list(range(45))


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


def test_loaded_memory_is_bounded(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    tracker = make_tracker(clock, storage, min_index_count=100, max_buckets=5, max_indexes_per_segment=10)
    rng = random.Random(5)
    start = clock.now_ms()
    for i in range(5000):
        tracker.add(i, start + 1 + rng.randrange(10_000))
        stats = tracker.stats()
        assert stats.loaded_indexes <= stats.mutable_indexes + stats.buckets * 10
    # 49 seals of 100: buckets grow to 5, then each 4-way merge takes them to 3, so 3, 4, 5, 3, ...
    assert tracker.stats().buckets == 4 and len(tracker) == 5000


def test_invalid_config_is_rejected(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    with pytest.raises(ConfigError, match="max_buckets"):
        make_tracker(clock, storage, max_buckets=0)


def test_sealing_50k_entries_is_cheap(clock: ManualClock, storage: FakeSnapshotStorage) -> None:
    """Pulsar #24603 took 1.5 s per seal; here a seal of 50,000 entries stays well under that."""
    tracker = BucketTracker(clock, storage, "t/0", retry_backoff_s=0)
    rng = random.Random(1)
    start = clock.now_ms()
    for i in range(50_000):
        tracker.add(i, start + 1 + rng.randrange(7 * 86_400_000))
    began = time.perf_counter()
    assert tracker.seal()
    elapsed = time.perf_counter() - began
    assert tracker.stats().buckets == 1
    assert elapsed < 0.5, f"sealing 50k entries took {elapsed:.3f} s"
