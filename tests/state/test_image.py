"""The state topic's records without Kafka: a mirrored tracker's snapshots, read back into a new tracker.

The property: whatever a tracker did (adds, pops, seals, merges, deletes, checkpoints), an index
restored from the last manifest it published, plus the log read again from the manifest's tail
(or from the commit, if earlier), holds exactly the entries the tracker still had pending at the
commit: none lost, none twice, none that was delivered.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.clock import ManualClock
from sidecar.state.image import ImageError, Manifest, Record, image_of, manifest_key
from sidecar.state.mirror import MirroredStorage
from sidecar.tracker.base import Due
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.storage import FakeSnapshotStorage
from sidecar.tracker.storage.base import pack_key
from tests.tracker.conftest import make_tracker

PARTITION = "orders/3"
FAR = 10**12

Op = tuple[str, int]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 400)),
        st.tuples(st.just("advance"), st.integers(1, 120)),
        st.tuples(st.just("checkpoint"), st.integers(0, 1)),
    ),
    max_size=160,
)


def publish(tracker: BucketTracker, mirror: MirroredStorage, cursor: int, topic: list[Record]) -> None:
    """What StateTopic.publish sends, in its order: new buckets, the manifest, tombstones."""
    buckets, next_id, lowest = tracker.sealed_layout()
    tail = min(o for o in (lowest, cursor) if o is not None)
    records, tombstones = mirror.take(PARTITION, buckets)
    topic += [*records, (manifest_key(PARTITION), Manifest(buckets, next_id, tail, cursor).encode()), *tombstones]


def pending_of(tracker: BucketTracker) -> list[Due]:
    return tracker.pop_due(10**9, until_ms=FAR)


@given(ops)
def test_a_restored_index_plus_the_tail_of_the_log_is_the_index_at_the_commit(script: list[Op]) -> None:
    clock = ManualClock(1_000_000)
    mirror = MirroredStorage(FakeSnapshotStorage())
    tracker = make_tracker(clock, mirror, PARTITION)
    log: list[tuple[int, int]] = []
    topic: list[Record] = []
    for op, value in script:
        if op == "add":
            offset = len(log)
            log.append((offset, clock.now_ms() + value))
            tracker.add(offset, clock.now_ms() + value)
        elif op == "advance":
            clock.advance(value)
            tracker.pop_due(1_000)
        else:
            tracker.checkpoint(len(log))
            if value:
                publish(tracker, mirror, len(log), topic)
    tracker.checkpoint(len(log))  # the commit: cursor and watermark
    committed, through = len(log), tracker.delivered_through()
    earliest = tracker.earliest_pending_offset()
    expected = pending_of(tracker)

    image = image_of(PARTITION, topic)
    manifest = image.manifest()
    if manifest is None:
        return  # nothing published: the new owner reads the log again from the earliest pending
    restored = make_tracker(clock, FakeSnapshotStorage(), PARTITION)
    restored.restore(image.buckets(manifest), manifest.next_bucket_id, through)
    start = max(earliest if earliest is not None else committed, min(manifest.tail, committed))
    sent_at_reread = []
    for offset, at in log[start:]:
        if pack_key(at, offset) > through and not restored.add(offset, at):
            sent_at_reread.append(Due(at, offset))
    got = sorted(sent_at_reread + pending_of(restored))
    assert got == sorted(expected)


def test_a_manifest_names_only_buckets_below_its_next_id() -> None:
    with pytest.raises(ImageError):
        Manifest.decode(Manifest((1, 5), 5, 0, 0).encode())
    with pytest.raises(ImageError):
        Manifest.decode(Manifest((2, 2), 5, 0, 0).encode())


@given(st.one_of(st.binary(max_size=64), st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=4))))
def test_a_manifest_that_is_not_ours_is_an_image_error_never_a_crash(data: bytes | dict[str, object]) -> None:
    raw = data if isinstance(data, bytes) else json.dumps({"v": 1, **data}).encode()
    try:
        manifest = Manifest.decode(raw)
    except ImageError:
        return
    assert Manifest.decode(manifest.encode()) == manifest


def test_a_bucket_with_a_missing_segment_is_not_used() -> None:
    clock = ManualClock(1_000_000)
    mirror = MirroredStorage(FakeSnapshotStorage())
    tracker = make_tracker(clock, mirror, PARTITION, max_indexes_per_segment=2)
    for offset in range(12):
        tracker.add(offset, clock.now_ms() + 10 + offset)
    topic: list[Record] = []
    publish(tracker, mirror, 12, topic)
    image = image_of(PARTITION, topic)
    manifest = image.manifest()
    assert manifest is not None and manifest.buckets
    image.take(f"{PARTITION}/bucket/{manifest.buckets[0]}/segment/1".encode(), None)
    with pytest.raises(ImageError, match="segment 1 of bucket"):
        image.buckets(manifest)


def test_another_partitions_records_are_not_part_of_the_image() -> None:
    image = image_of("orders/1", [(b"orders/10/manifest", b"{}"), (b"orders/1/manifest", b"x")])
    assert image.values == {b"orders/1/manifest": b"x"}


def test_after_a_restart_from_local_state_the_live_buckets_are_sent_again_whole() -> None:
    """A crash between a seal and the next checkpoint leaves the state topic without the bucket."""
    clock = ManualClock(1_000_000)
    local = FakeSnapshotStorage()
    tracker = make_tracker(clock, MirroredStorage(local), PARTITION)
    for offset in range(25):
        tracker.add(offset, clock.now_ms() + 100 + offset)
    tracker.checkpoint(25)  # sealed buckets, never sent: the process dies here
    mirror = MirroredStorage(local)
    again = make_tracker(clock, mirror, PARTITION)
    topic: list[Record] = []
    publish(again, mirror, 25, topic)
    image = image_of(PARTITION, topic)
    manifest = image.manifest()
    assert manifest is not None and manifest.buckets
    restored = make_tracker(clock, FakeSnapshotStorage(), PARTITION)
    restored.restore(image.buckets(manifest), manifest.next_bucket_id, 0)
    assert len(restored) == manifest.tail  # every offset below the tail is sealed, none popped
    topic.clear()
    publish(again, mirror, 25, topic)
    assert [key for key, _ in topic] == [manifest_key(PARTITION)], "sent twice"


def test_a_bucket_merged_away_before_it_was_sent_is_neither_sent_nor_tombstoned() -> None:
    clock = ManualClock(1_000_000)
    mirror = MirroredStorage(FakeSnapshotStorage())
    tracker = make_tracker(clock, mirror, PARTITION, max_buckets=1)
    for offset in range(35):  # three seals, each merged into the one before
        tracker.add(offset, clock.now_ms() + 100 + offset)
    topic: list[Record] = []
    publish(tracker, mirror, 35, topic)
    (live,), _, _ = tracker.sealed_layout()
    named = {key.decode().split("/")[3] for key, _ in topic if b"/bucket/" in key}
    assert named == {str(live)}
    assert all(value is not None for _, value in topic)


def test_a_new_engine_sends_every_live_bucket_again() -> None:
    """What the last engine sent may have been purged (a failed flush) or aborted (exactly-once)."""
    clock = ManualClock(1_000_000)
    mirror = MirroredStorage(FakeSnapshotStorage())
    tracker = make_tracker(clock, mirror, PARTITION)
    for offset in range(25):
        tracker.add(offset, clock.now_ms() + 100 + offset)
    first: list[Record] = []
    publish(tracker, mirror, 25, first)
    mirror.reset()
    again: list[Record] = []
    publish(tracker, mirror, 25, again)
    assert {key for key, _ in again} == {key for key, _ in first}


def test_an_index_started_afresh_takes_bucket_ids_no_record_or_manifest_uses() -> None:
    image = image_of(PARTITION, [(f"{PARTITION}/bucket/7/meta".encode(), b"m")])
    assert image.first_free_bucket_id() == 8
    image.take(manifest_key(PARTITION), Manifest((7,), 12, 0, 0).encode())
    assert image.first_free_bucket_id() == 12
    image.take(manifest_key(PARTITION), b"not json")
    assert image.first_free_bucket_id() == 8
    assert image_of(PARTITION, []).first_free_bucket_id() == 1


def test_records_of_an_unusable_index_are_tombstoned_after_the_next_manifest() -> None:
    image = image_of(PARTITION, [(f"{PARTITION}/bucket/3/meta".encode(), b"m"), (manifest_key(PARTITION), b"{}")])
    mirror = MirroredStorage(FakeSnapshotStorage())
    mirror.drop_later(PARTITION, image.bucket_keys())
    assert mirror.take(PARTITION, ()) == ([], [(f"{PARTITION}/bucket/3/meta".encode(), None)])
