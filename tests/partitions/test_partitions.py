"""Partition state without Kafka: the commit metadata, the rule history, and the start decision."""

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.clock import ManualClock
from sidecar.inbound.keys import is_keyed, keyed_of
from sidecar.partitions.keyed import KeyedPartition
from sidecar.partitions.metadata import MAX_METADATA_BYTES, CommitMetadata, RuleHistory
from sidecar.partitions.state import PartitionState
from sidecar.policy import by_key
from sidecar.policy.by_key import BEFORE_ANY
from sidecar.policy.model import EffectiveDelay, Sourced
from sidecar.policy.routes import IntakeRule
from sidecar.tracker import InMemoryTracker
from sidecar.tracker.base import NOTHING_DELIVERED, pack
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.keys import MemoryKeys
from sidecar.tracker.storage.fake import FakeSnapshotStorage

FAR = 10**13


def rule(max_ms: int = 0, delayed: tuple[str, ...] = ("a",)) -> IntakeRule:
    delay = EffectiveDelay(Sourced(True, "topic"), Sourced(max_ms, "topic"), Sourced(0, "topic"))
    return IntakeRule(delay, None, delayed)


@given(
    earliest=st.none() | st.integers(0, 2**62),
    through=st.just(NOTHING_DELIVERED) | st.builds(pack, st.integers(0, 2**45), st.integers(0, 2**62)),
    rules=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 10**9)), max_size=5),
    clock=st.none() | st.integers(0, 2**45),
)
def test_commit_metadata_round_trips(
    earliest: int | None, through: int, rules: list[tuple[int, int]], clock: int | None
) -> None:
    history = tuple((offset, rule(max_ms)) for offset, max_ms in rules)
    metadata = CommitMetadata(earliest, through, history, clock=clock)
    decoded = CommitMetadata.decode(metadata.encode())
    assert (decoded.earliest, decoded.through, decoded.clock) == (earliest, through, clock)
    assert [(o, r.key) for o, r in decoded.rules] == [(o, r.key) for o, r in metadata.rules]


def test_older_and_foreign_metadata() -> None:
    assert CommitMetadata.decode('{"v":1,"earliest":7}') == CommitMetadata(7)
    for text in (None, "", "not json", '{"v":9,"earliest":7}', "[]"):
        assert CommitMetadata.decode(text) == CommitMetadata()


def test_a_history_past_kafkas_limit_is_spilled_whole_and_named_by_the_metadata() -> None:
    many = tuple((i * 10, rule(max_ms=i, delayed=("subscription-" + "x" * 40,))) for i in range(200))
    metadata = CommitMetadata(0, NOTHING_DELIVERED, many)
    text = metadata.encode()
    assert len(text) <= MAX_METADATA_BYTES
    decoded = CommitMetadata.decode(text)
    assert decoded.rules[-1][0] == 1990  # the newest that fit, for when the state topic is unreadable
    spilled = metadata.spill()
    assert spilled is not None and decoded.rules_ref == spilled[0]
    whole = CommitMetadata.decode_rules(spilled[1])
    assert [(o, r.key) for o, r in whole] == [(o, r.key) for o, r in many]
    assert CommitMetadata(0, NOTHING_DELIVERED, many[:2]).spill() is None  # fits: nothing to spill
    assert CommitMetadata.decode(CommitMetadata(0, NOTHING_DELIVERED, many[:2]).encode()).rules_ref is None


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=6), max_leaves=20))  # fmt: skip
def test_a_spilled_history_that_is_not_one_is_a_value_error(item: object) -> None:
    try:
        rules = CommitMetadata.decode_rules(json.dumps(item).encode())
    except ValueError:
        return
    assert isinstance(rules, tuple)


def test_rule_history_finds_the_rule_of_an_offset_and_forgets_what_nothing_needs() -> None:
    history = RuleHistory()
    loose, tight = rule(max_ms=60_000), rule(max_ms=5_000)
    history.note(0, loose)
    history.note(5, rule(max_ms=60_000))  # the same values: no new entry
    history.note(10, tight)
    assert history.single is None and [o for o, _ in history.items()] == [0, 10]
    assert history.at(9) is not None and history.at(9).key == loose.key  # type: ignore[union-attr]
    assert history.at(10) is tight and history.at(99) is tight
    history.prune(12)
    assert history.single is tight


def state(tracker: InMemoryTracker | BucketTracker, control: bool = False) -> PartitionState:
    return PartitionState("orders", 0, tracker, control=control)


def test_without_local_state_the_index_is_rebuilt_from_the_earliest_pending_offset() -> None:
    s = state(InMemoryTracker(ManualClock()))
    assert s.start(100, CommitMetadata(40, pack(5, 39))) == 40
    assert s.rebuild is not None and (s.rebuild.start, s.rebuild.until, s.rebuild.through) == (40, 100, pack(5, 39))
    assert s.tracker.delivered_through() == pack(5, 39)
    assert s.commit_point(None) is None  # never during a rebuild


def test_control_partitions_replay_accepted_nacks_without_judging_commands_again() -> None:
    s = state(InMemoryTracker(ManualClock()), control=True)
    assert s.start(100, CommitMetadata(40, pack(5, 39))) == 40
    assert s.rebuild is None and (s.replay_until, s.tracker.delivered_through()) == (100, pack(5, 39))


def bucket(storage: FakeSnapshotStorage) -> BucketTracker:
    return BucketTracker(ManualClock(), storage, "orders/0")


def started(
    storage: FakeSnapshotStorage, committed: int | None, metadata: CommitMetadata, exact: bool = False
) -> PartitionState:
    s = PartitionState("orders", 0, bucket(storage), exact=exact)
    s.start(committed, metadata)
    return s


def checkpoint(s: PartitionState, committed: bool = True) -> tuple[int, CommitMetadata]:
    """What checkpoint.py does for one partition: the point, the tracker's checkpoint, the commit
    (`committed=False`: the process dies between the last two)."""
    point = s.commit_point(s.tracker.earliest_pending_offset())
    assert point is not None and s.next_offset is not None
    s.tracker.checkpoint(s.next_offset, s.lineage, s.point_rules)
    if committed:
        s.committed, s.committed_fingerprint = point, s.lineage[0]
    return point[0], CommitMetadata.decode(point[1])


def served(storage: FakeSnapshotStorage) -> tuple[PartitionState, tuple[int, CommitMetadata]]:
    """A partition served from nothing: offset 5 pending far ahead, read to 10, committed."""
    s = started(storage, None, CommitMetadata())
    s.tracker.add(5, FAR)
    s.next_offset = 10
    return s, checkpoint(s)


def test_local_state_is_used_when_it_agrees_with_the_commit() -> None:
    storage = FakeSnapshotStorage()
    _, commit = served(storage)
    s = started(storage, *commit)
    assert s.next_offset == 10 and s.rebuild is None and s.tracker.contains(5)
    assert started(storage, *commit, exact=True).next_offset == 10
    # an exactly-once claim renames the producer of the commit and changes nothing else
    claimed = started(storage, commit[0], replace(commit[1], producer="another-member"), exact=True)
    assert claimed.next_offset == 10 and claimed.rebuild is None


def test_at_least_once_local_state_one_checkpoint_ahead_of_the_commit_is_used() -> None:
    """The process died between its index's fsync and its commit: the deliveries the index has
    taken since were acknowledged (checkpoint.py, step 1)."""
    storage = FakeSnapshotStorage()
    s, commit = served(storage)
    s.tracker.add(12, FAR)
    s.next_offset = 15
    checkpoint(s, committed=False)
    assert started(storage, *commit).next_offset == 15
    exact = started(storage, *commit, exact=True)  # its pops may be deliveries of an aborted transaction
    assert exact.rebuild is not None and exact.rebuild.start == 5 and exact.tracker.index_cursor() is None


def test_at_least_once_local_state_ahead_of_the_commit_brings_the_rules_it_was_judged_by() -> None:
    """A policy change between the commit and the local checkpoint: the records read after it were
    judged by the new rule, which only the local state names. Taken from the commit, a later
    rebuild by another member judged them by the old one: a chaos run at 9a6cf95 dead-lettered
    records under a tightened max delay, then, after a kill -9 and a handoff, delivered them."""
    storage = FakeSnapshotStorage()
    s = started(storage, None, CommitMetadata())
    s.rules.note(0, rule())
    s.tracker.add(5, FAR)
    s.next_offset = 10
    commit = checkpoint(s)
    s.rules.note(10, rule(max_ms=5_000))
    s.next_offset = 15
    checkpoint(s, committed=False)
    again = started(storage, *commit)
    assert again.next_offset == 15
    assert [(o, r.key) for o, r in again.rules.items()] == [(0, rule().key), (10, rule(max_ms=5_000).key)]
    again.tracker.add(16, FAR)
    again.next_offset = 20
    point = again.commit_point(again.tracker.earliest_pending_offset())
    assert point is not None and CommitMetadata.decode(point[1]).rules[-1][0] == 10  # the next commit names it


def test_local_state_overtaken_by_another_member_is_rebuilt_from_the_commit() -> None:
    """Another member owned the partition since, and its commit differs in a field that decides a
    fate: a drain of the removed topic moved `earliest` (the cursor and watermark stay: issue 48's
    first case), a delivery moved the watermark, a cancel, a new rule. Each is rebuilt, in both modes."""
    _, (offset, metadata) = served(FakeSnapshotStorage())
    overtaken = {
        "drained": replace(metadata, earliest=8),
        "delivered": replace(metadata, through=pack(FAR, 5)),
        "cancelled": replace(metadata, commands=True),
        "rules": replace(metadata, rules=((0, rule(max_ms=1_000)),)),
    }
    for why, commit in overtaken.items():
        for exact in (False, True):
            storage = FakeSnapshotStorage()
            served(storage)
            s = started(storage, offset, commit, exact)
            expected = commit.earliest if commit.earliest is not None else offset
            assert not s.tracker.contains(5), why
            assert s.tracker.index_cursor() is None, why
            assert (s.rebuild.start if s.rebuild else s.next_offset) == expected, why
    storage = FakeSnapshotStorage()
    served(storage)
    assert started(storage, 12, metadata).tracker.index_cursor() is None  # read on by another member


def test_local_state_without_a_lineage_is_rebuilt_once() -> None:
    """An index written before lineages were kept names no commit: it is rebuilt, then kept."""
    storage = FakeSnapshotStorage()
    tracker = bucket(storage)
    tracker.add(5, FAR)
    tracker.checkpoint(10)
    s = started(storage, 10, CommitMetadata(5))
    assert s.rebuild is not None and s.rebuild.start == 5


def test_a_commit_only_when_something_changed() -> None:
    storage = FakeSnapshotStorage()
    s = state(bucket(storage))
    assert s.start(None, CommitMetadata()) is None
    assert s.commit_point(None) is None  # nothing read yet
    s.next_offset = 3
    point = s.commit_point(None)
    assert point is not None and point[0] == 3
    s.committed, s.committed_fingerprint = point, s.lineage[0]
    assert s.commit_point(None) is None
    assert s.lineage == (s.committed_fingerprint,)


def test_exactly_once_discards_local_state_ahead_of_the_commit() -> None:
    """A crash after the tracker checkpoint and before commit_transaction: the pops in local state
    were deliveries of an aborted transaction. Using the state would lose them; it is rebuilt."""
    storage = FakeSnapshotStorage()
    s = started(storage, None, CommitMetadata(), exact=True)
    clock = s.tracker.clock
    assert isinstance(clock, ManualClock)
    assert s.tracker.add(5, clock.now_ms() + 100)
    s.tracker.add(6, FAR)
    s.next_offset = 10
    commit = checkpoint(s)  # committed as (10, earliest 5, nothing delivered)
    clock.advance(200)
    assert [d.offset for d in s.tracker.pop_due(10)] == [5]
    checkpoint(s, committed=False)  # then the crash: the transaction with offset 5's delivery is aborted
    exact = started(storage, *commit, exact=True)  # rebuilt from the commit: offset 5 is delivered again
    assert exact.rebuild is not None and exact.rebuild.start == 5
    assert exact.rebuild.through <= 0 and len(exact.tracker) == 0  # nothing delivered


def test_exactly_once_ignores_local_state_when_nothing_is_committed() -> None:
    storage = FakeSnapshotStorage()
    served(storage)
    fresh = started(storage, None, CommitMetadata(), exact=True)
    assert fresh.next_offset is None and fresh.tracker.index_cursor() is None  # the state is not ours


def test_an_exactly_once_rebuild_indexes_due_records_instead_of_delivering_them() -> None:
    """Read in offset order, a rebuild's deliveries would not follow the watermark's order."""
    clock = ManualClock(start_ms=1_000)
    for tracker in (InMemoryTracker(clock), bucket(FakeSnapshotStorage())):
        tracker.clock = clock
        assert tracker.add(1, 500, deliver_now=False)
        assert tracker.add(2, 400, deliver_now=False)
        assert [d.offset for d in tracker.pop_due(10)] == [2, 1]
        assert not tracker.add(3, 300, deliver_now=False)  # at or below the watermark: done already
    s = PartitionState("orders", 0, InMemoryTracker(clock), control=True, exact=True)
    s.start(100, CommitMetadata(40, NOTHING_DELIVERED))
    s.next_offset = 41
    assert s.replaying and s.commit_point(None, exact=True) is None
    s.next_offset = 100
    assert not s.replaying and s.commit_point(None, exact=True) is not None


def test_an_index_from_the_state_topic_is_completed_from_its_tail_or_the_commit() -> None:
    calls = []

    def restore(s: PartitionState, committed: int, metadata: CommitMetadata) -> int | None:
        calls.append(committed)
        return 70

    s = state(InMemoryTracker(ManualClock()))
    assert s.start(100, CommitMetadata(40, pack(5, 39)), restore) == 70
    assert s.rebuild is not None and (s.rebuild.start, s.rebuild.until) == (70, 100)
    late = state(InMemoryTracker(ManualClock()))  # a manifest ahead of the commit: read from the commit
    assert late.start(100, CommitMetadata(40), lambda *_: 120) == 100 and late.rebuild is None
    early = state(InMemoryTracker(ManualClock()))  # everything below the commit's earliest was delivered
    assert early.start(100, CommitMetadata(80), lambda *_: 70) == 80
    nothing = state(InMemoryTracker(ManualClock()))
    assert nothing.start(100, CommitMetadata(40), lambda *_: None) == 40
    assert calls == [100]


def test_a_commit_with_monotone_runs_pending_is_read_again_from_its_earliest_even_after_a_restore() -> None:
    """Written with --monotone-runs (since removed): run members are in no bucket, only the log has
    them. The buckets are restored all the same, so the index's new buckets take ids after those
    the state topic holds."""
    legacy = CommitMetadata.decode('{"v":2,"earliest":40,"runs":[[50,1000,60,1010,64]],"rules":[]}')
    restored: list[int] = []
    s = state(InMemoryTracker(ManualClock()))
    assert s.start(100, legacy, lambda _, committed, __: restored.append(committed) or 90) == 40
    assert s.rebuild is not None and s.rebuild.start == 40
    assert restored == [100]


def test_a_claim_renames_the_producer_of_the_last_commit_and_nothing_else() -> None:
    state = PartitionState("t", 0, InMemoryTracker(ManualClock(0)), exact=True)
    assert state.claim_point("p-2") is None  # nothing committed: nothing to claim
    text = CommitMetadata(earliest=3, through=pack(10, 2), producer="p-1").encode()
    state.committed = (7, text)
    offset, claimed = state.claim_point("p-2") or (None, "")
    assert offset == 7
    assert CommitMetadata.decode(claimed) == replace(CommitMetadata.decode(text), producer="p-2")
    state.committed = (7, claimed)
    assert state.claim_point("p-2") is None  # named already
    state.committed = (7, "written by another tool")
    assert state.claim_point("p-2") is None  # foreign metadata is left alone


def test_a_keyed_partitions_commit_carries_the_logs_clock_at_its_earliest_and_a_new_owner_starts_with_it() -> None:
    """policy/by_key.py: a rebuild from `earliest` must know the greatest timestamp below it, or a
    record stamped ahead below it would be forgotten and a record due already could be replaced."""
    s = state(InMemoryTracker(ManualClock(0)))
    s.start(None, CommitMetadata())
    keyed = KeyedPartition(MemoryKeys())
    s.keyed, s.next_offset = keyed, 40
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(by_key, "SAMPLE_EVERY", 10)  # sampled at 10, 20 and 30
        for offset, stamp in ((10, 1_000), (11, 5_000), (20, 2_000), (29, 6_000), (30, 3_000)):
            keyed.note(offset, stamp)
    point = s.commit_point(earliest_pending=25)
    assert point is not None
    metadata = CommitMetadata.decode(point[1])
    # Down to the sample at 20, with the clock before it (6,000 is at 29, not below 20).
    assert (metadata.earliest, metadata.clock) == (20, 5_000)
    nothing_pending = s.commit_point(earliest_pending=None)
    assert nothing_pending is not None
    # Nothing pending: no rebuild, and the clock has read every record below the commit.
    assert (CommitMetadata.decode(nothing_pending[1]).earliest, CommitMetadata.decode(nothing_pending[1]).clock) == (
        40,
        6_000,
    )
    successor = state(InMemoryTracker(ManualClock(0)))
    assert successor.start(40, metadata) == 20  # the rebuild starts at the sample
    assert keyed_of(successor).step.clock.now == 5_000
    # Keyed state that has read nothing below its earliest still says so: the next owner starts it
    # at its first record, whatever rule that record was read by, and moves the clock from there.
    fresh = state(InMemoryTracker(ManualClock(0)))
    fresh.start(None, CommitMetadata())
    fresh.keyed, fresh.next_offset = KeyedPartition(MemoryKeys()), 60
    fresh.keyed.note(50, 7_000)
    point = fresh.commit_point(earliest_pending=50)
    assert point is not None and CommitMetadata.decode(point[1]).clock == BEFORE_ANY
    plain = IntakeRule(EffectiveDelay(Sourced(True, "topic"), Sourced(0, "topic"), Sourced(0, "topic")), None, ("a",))
    after = state(InMemoryTracker(ManualClock(0)))
    after.start(60, CommitMetadata.decode(point[1]))
    assert is_keyed(after, plain) and not plain.keyed
