"""A control partition's nacks in the state topic, without Kafka.

The property: whatever a sidecar did with its nacks (accepted, superseded, accepted twice,
redelivered, checkpointed in either mode), a new owner that loads the nacks from the state topic
and reads the control log again from the manifest's tail redelivers exactly what one that reads
the whole control log again from the earliest pending nack would (the path without a state topic),
and so does an owner after it, once the first has checkpointed. Before any commit, a new owner
reads the whole log and redelivers every nack in force once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pyroaring import BitMap

from sidecar.clock import ManualClock
from sidecar.control.commands import AcceptedNack, ControlPosition, NackCommand
from sidecar.control.nacks import LatestNacks
from sidecar.state import journal as journal_module
from sidecar.state.image import ImageError, Manifest, Record, image_of, manifest_key
from sidecar.state.journal import NackJournal
from sidecar.tracker import InMemoryTracker
from sidecar.tracker.base import NOTHING_DELIVERED, pack

PARTITION = "ctl/0"
CONTROL = ("ctl", 0)
FAR = 10**12
Commit = tuple[int, int, int]
"""(committed offset, delivered watermark, earliest pending offset)"""

nack = st.tuples(st.just("nack"), st.integers(0, 3), st.integers(0, 60))  # message, delay
ops = st.lists(
    st.one_of(
        nack,
        nack,
        st.tuples(st.just("advance"), st.integers(1, 40), st.just(0)),
        st.tuples(st.just("checkpoint"), st.sampled_from([0, 0, 1]), st.just(0)),  # 1: a crash after the publish
        st.tuples(st.just("twice"), st.just(0), st.just(0)),  # the last acceptance written again
        st.tuples(st.just("early"), st.just(0), st.just(0)),  # StateTopic.journal between checkpoints
    ),
    min_size=3,
    max_size=80,
)


class Owner:
    """One owner of the control partition: Acceptance, Redelivery and StateTopic, reduced to their decisions."""

    def __init__(self, clock: ManualClock, exact: bool) -> None:
        self.clock, self.exact = clock, exact
        self.tracker = InMemoryTracker(clock)
        self.nacks = LatestNacks(changelog=True)
        self.redelivered: list[int] = []
        self.commit: Commit | None = None
        self.cursor = 0
        self.published = False
        self.journal = NackJournal(PARTITION)
        self.unsettled: list[Record] = []
        """Exactly once: records written since the last commit, in the open transaction."""

    def read(
        self, log: list[AcceptedNack], until: int, replay_until: int = 0, through: int = -1, hold: bool = False
    ) -> None:
        """Acceptance.take over the control log up to `until`; `hold`: deliver nothing while reading."""
        for offset in range(self.cursor, until):
            nack = log[offset]
            self.nacks.accept(nack, offset)
            if offset < replay_until and pack(nack.deliver_at, offset) <= through:
                self.nacks.claim(nack, offset)
            elif not self.tracker.add(offset, nack.deliver_at, deliver_now=offset >= replay_until and not hold):
                self.settle(nack, offset)
        self.cursor = max(self.cursor, until)

    def deliver(self, log: list[AcceptedNack], until_ms: int | None = None) -> None:
        for due in self.tracker.pop_due(10**9, until_ms=until_ms):
            self.settle(log[due.offset], due.offset)

    def settle(self, nack: AcceptedNack, offset: int) -> None:
        if self.nacks.claim(nack, offset):
            self.redelivered.append(offset)

    def changes(self, manifest: bool = True) -> tuple[list[Record], list[Record]]:
        through = self.tracker.delivered_through()
        covered = through if self.exact else (self.commit[1] if self.commit else NOTHING_DELIVERED)
        return self.journal.write(*self.nacks.take(CONTROL, covered), manifest)

    def early(self, topic: list[Record]) -> None:
        """StateTopic.journal: the changes without a manifest (in the transaction, exactly once)."""
        before, after = self.changes(manifest=False)
        (self.unsettled if self.exact else topic).extend([*before, *after])

    def checkpoint(self, topic: list[Record], fails: bool) -> None:
        """StateTopic._publish_nacks, then the commit, unless the owner crashes in between."""
        through = self.tracker.delivered_through()
        before, after = self.changes()
        if before or after or self.unsettled or not self.published:
            manifest = self.journal.manifest(self.cursor)
            written = [*self.unsettled, *before, (manifest_key(PARTITION), manifest.encode()), *after]
            self.unsettled = []
            if not (fails and self.exact):  # a transaction that does not commit leaves nothing visible
                topic += written
                self.published = True
        if not fails:
            earliest = self.tracker.earliest_pending_offset()
            self.commit = (self.cursor, through, self.cursor if earliest is None else earliest)


def take_over(
    clock: ManualClock, exact: bool, log: list[AcceptedNack], commit: Commit, topic: list[Record] | None
) -> Owner:
    """PartitionState.start with StateTopic.restore (a topic) or without (None), then the log to its end."""
    committed, through, earliest = commit
    owner = Owner(clock, exact)
    owner.commit = commit
    owner.tracker.restore_delivered_through(through)
    start = earliest
    if topic is not None:
        image = image_of(PARTITION, topic)
        manifest = image.manifest()
        if manifest is not None:
            restored = NackJournal.restore(image, manifest, through)
            for offset, nack in restored.pending:
                owner.tracker.add(offset, nack.deliver_at, deliver_now=False)
                owner.nacks.restore(nack, offset)
            for offset, nack in restored.legacy:
                owner.tracker.add(offset, nack.deliver_at, deliver_now=False)
                owner.nacks.accept(nack, offset)
            owner.journal = restored.journal
            start = max(earliest, min(manifest.tail, committed))
            owner.published = True
    owner.cursor = start
    owner.read(log, committed, replay_until=committed, through=through)
    owner.read(log, len(log), hold=True)  # (when a record read live goes out is timing, not state)
    return owner


@pytest.mark.parametrize("chunk_bytes", [300, journal_module.CHUNK_BYTES], ids=["chunks-of-2", "one-chunk"])
@pytest.mark.parametrize("exact", [False, True], ids=["at-least-once", "exactly-once"])
@settings(max_examples=1500)  # (400 missed a dead set never written)
@given(script=ops)
def test_nacks_from_the_state_topic_plus_the_tail_are_the_nacks_of_a_full_replay(
    exact: bool, chunk_bytes: int, script: list[tuple[str, int, int]]
) -> None:
    saved, journal_module.CHUNK_BYTES = journal_module.CHUNK_BYTES, chunk_bytes
    try:
        replay_and_compare(exact, script)
    finally:
        journal_module.CHUNK_BYTES = saved


def replay_and_compare(exact: bool, script: list[tuple[str, int, int]]) -> None:
    clock = ManualClock(1_000_000)
    owner = Owner(clock, exact)
    log: list[AcceptedNack] = []
    topic: list[Record] = []
    command = 0
    for op, a, b in script:
        if op == "nack":
            command += 1
            log.append(
                AcceptedNack(NackCommand("s", "t", 0, a, None, None, 0), clock.now_ms() + b, (*CONTROL, command))
            )
        elif op == "twice" and log:
            log.append(log[-1])
        elif op == "advance":
            clock.advance(a)
        elif op == "early":
            owner.early(topic)
        elif op == "checkpoint":
            owner.checkpoint(topic, fails=bool(a))
            if a:
                break  # the engine starts again: a new owner takes over from the commit
        owner.read(log, len(log))
        owner.deliver(log)
    assert_image_holds_only_acceptances(log, topic)
    if owner.commit is None:
        event("nothing committed: a full read of the log")
        assert_a_new_owner_redelivers_every_nack_in_force_once(clock, exact, log)
        return
    event("committed: the state topic against a full replay")
    replayed = take_over(clock, exact, log, owner.commit, None)
    restored = take_over(clock, exact, log, owner.commit, topic)
    restored.checkpoint(topic, fails=True)  # its changes written, the commit unchanged
    again = take_over(clock, exact, log, owner.commit, topic)
    for new_owner in (replayed, restored, again):
        new_owner.deliver(log, until_ms=FAR)
    if not any(op == "twice" for op, _, _ in script):
        assert restored.redelivered == replayed.redelivered
        assert again.redelivered == replayed.redelivered
    # Counted per acceptance, with what the first owner redelivered under the commit. An acceptance
    # written once comes back once in all, as in the replay. One written twice (at least once: a
    # crash before its command's commit) is redelivered again by any owner that reads a copy after
    # the first was settled, and a full replay may also redeliver a copy a restore knows to be dead:
    # it comes back, and no more often than in the replay.
    copies = Counter(nack.source for nack in log)
    covered = sources(log, (o for o in owner.redelivered if pack(log[o].deliver_at, o) <= owner.commit[1]))
    expected = covered + sources(log, replayed.redelivered)
    for new_owner in (restored, again):
        found = covered + sources(log, new_owner.redelivered)
        assert found.keys() == expected.keys()
        for source, times in found.items():
            if copies[source] == 1:
                assert (times, expected[source]) == (1, 1), source
            else:
                assert times <= expected[source], source


def sources(log: list[AcceptedNack], offsets: Iterable[int]) -> Counter[ControlPosition]:
    """Redeliveries per acceptance (its command's position): copies of one acceptance count together."""
    return Counter(log[offset].source for offset in offsets)


def assert_a_new_owner_redelivers_every_nack_in_force_once(
    clock: ManualClock, exact: bool, log: list[AcceptedNack]
) -> None:
    """With nothing committed, PartitionState.start reads the control log from its start and not
    the state topic: each message's latest nack (the one in force) must come back once, even those
    the first owner redelivered already, since no commit covers them; a copy or a superseded one never."""
    latest: dict[tuple[str, str, int, int], ControlPosition] = {}
    for nack in log:
        known = latest.get(nack.command.message_key)
        if known is None or known[2] < nack.source[2]:
            latest[nack.command.message_key] = nack.source
    fresh = take_over(clock, exact, log, (0, NOTHING_DELIVERED, 0), None)
    fresh.deliver(log, until_ms=FAR)
    assert sources(log, fresh.redelivered) == Counter(latest.values())


def assert_image_holds_only_acceptances(log: list[AcceptedNack], topic: list[Record]) -> None:
    """Once a manifest is published, whatever the image restores is an accepted nack at its own offset
    (as its record in the control topic reads: the journal keeps that, not the command as sent)."""
    image = image_of(PARTITION, topic)
    manifest = image.manifest()
    if manifest is not None:
        restored = NackJournal.restore(image, manifest, NOTHING_DELIVERED)
        for offset, nack in [*restored.pending, *restored.legacy]:
            assert nack.encode() == log[offset].encode(), offset


def restore(
    records: list[Record], through: int = -1
) -> tuple[NackJournal, list[tuple[int, AcceptedNack]], list[tuple[int, AcceptedNack]]]:
    image = image_of(PARTITION, records)
    manifest = image.manifest()
    assert manifest is not None
    restored = NackJournal.restore(image, manifest, through)
    return restored.journal, restored.pending, restored.legacy


def written(
    journal: NackJournal, pending: list[tuple[tuple[int, str], bytes]], dead: list[tuple[int, str]], cursor: int = 100
) -> list[Record]:
    before, after = journal.write(pending, dead)
    return [*before, (manifest_key(PARTITION), journal.manifest(cursor).encode()), *after]


def accepted(sub: str, offset: int, deliver_at: int = 5_000) -> AcceptedNack:
    return AcceptedNack(NackCommand(sub, "t", 0, 1, None, deliver_at, 0), deliver_at, (*CONTROL, offset))


def test_unreadable_nack_records_are_an_image_error() -> None:
    manifest = (manifest_key(PARTITION), Manifest((), 1, 0, 0).encode())
    with pytest.raises(ImageError, match="offset 7"):
        restore([(f"{PARTITION}/nack/7".encode(), b"{not json"), manifest])
    with pytest.raises(ImageError, match="names no offset"):
        restore([(f"{PARTITION}/nack/x".encode(), b"{}"), manifest])
    named = (manifest_key(PARTITION), Manifest((3,), 4, 0, 0).encode())
    with pytest.raises(ImageError, match="chunk 3 is named by the manifest but missing"):
        restore([named])
    for line in (b"{not json}", b"x " + accepted("b", 9).encode(), accepted("b", 9).encode()):
        with pytest.raises(ImageError, match="chunk 3 holds a line"):
            restore([(f"{PARTITION}/nacks/3".encode(), line), named])
    with pytest.raises(ImageError, match="dead set of nack chunk 3"):
        restore(
            [
                (f"{PARTITION}/nacks/3".encode(), b"9 " + accepted("b", 9).encode()),
                (f"{PARTITION}/nacks/3/dead".encode(), b"garbage"),
                named,
            ]
        )


def test_two_subscriptions_nacks_at_one_offset_are_both_restored_and_old_keys_are_journaled_again() -> None:
    billing, fraud = accepted("b", 9), accepted("f", 9)
    records = written(NackJournal(PARTITION), [((9, "b"), billing.encode()), ((9, "f"), fraud.encode())], [])
    old, older = accepted("b", 4, deliver_at=10), accepted("b", 5, deliver_at=20)
    legacy = [(f"{PARTITION}/nack/4".encode(), old.encode()), (f"{PARTITION}/nack/5/b".encode(), older.encode())]
    journal, pending, found = restore([*records, *legacy], through=pack(10, 4))
    assert pending == [(9, billing), (9, fraud)]
    assert found == [(5, older)]  # the one at 4 is covered
    before, after = journal.write([], [])
    assert before == []
    assert after == [(key, None) for key, _ in legacy]  # the old form goes once read


def test_a_chunk_lives_until_every_line_is_dead_and_the_manifest_names_only_live_chunks() -> None:
    nacks = [((o, "s"), accepted("s", o).encode()) for o in range(10)]
    journal = NackJournal(PARTITION)
    topic = written(journal, nacks[:5], [])
    topic += written(journal, nacks[5:], [(2, "s")])
    assert journal.live() == (1, 2)
    topic += written(journal, [], [(0, "s"), (1, "s"), (3, "s"), (4, "s"), (7, "s")])
    assert journal.live() == (2,)
    tombstones = [(f"{PARTITION}/nacks/1".encode(), None), (f"{PARTITION}/nacks/1/dead".encode(), None)]
    assert topic[-3:-1] == tombstones  # after the manifest, with chunk 2's dead set
    assert written(NackJournal(PARTITION), [], [(5, "s")]) == [
        (manifest_key(PARTITION), NackJournal(PARTITION).manifest(100).encode())
    ]
    journal, pending, _ = restore(topic, through=pack(5_000, 5))
    assert [offset for offset, _ in pending] == [6, 8, 9]  # 5 covered, 7 dead
    before, after = journal.write([((11, "s"), accepted("s", 11).encode())], [])
    assert [key for key, _ in before] == [f"{PARTITION}/nacks/3".encode(), f"{PARTITION}/nacks/3/dead".encode()]
    assert after == [(f"{PARTITION}/nacks/2/dead".encode(), journal._chunks[2].dead.serialize())]
    assert sorted(journal._chunks[2].dead) == [0, 2]  # lines of 5 and 7


def test_a_chunk_the_manifest_does_not_name_is_ignored_and_tombstoned() -> None:
    journal = NackJournal(PARTITION)
    topic = written(journal, [((1, "s"), accepted("s", 1).encode())], [])
    stray = (f"{PARTITION}/nacks/2".encode(), b"2 " + accepted("s", 2).encode())  # a crash before its manifest
    journal, pending, _ = restore([*topic, stray])
    assert [offset for offset, _ in pending] == [1]
    before, after = journal.write([((3, "s"), accepted("s", 3).encode())], [])
    assert before[0][0] == f"{PARTITION}/nacks/3".encode()  # a seq no record uses
    assert after == [(stray[0], None)]


def test_a_journal_started_afresh_takes_seqs_above_every_chunk_and_drops_the_old_ones() -> None:
    """Nothing was pending at the commit, so the owner did not restore: the last manifest may
    still name chunk 1, which must not be overwritten before a manifest of the new owner replaces it."""
    old = NackJournal(PARTITION)
    topic = written(old, [((1, "s"), accepted("s", 1).encode())], [])
    topic += written(old, [((2, "s"), accepted("s", 2).encode())], [])  # chunk 2
    fresh = NackJournal.unusable(PARTITION, image_of(PARTITION, topic[:5]))  # chunk 2, its manifest lost
    before, after = fresh.write([((5, "s"), accepted("s", 5).encode())], [])
    assert before[0][0] == f"{PARTITION}/nacks/3".encode()
    assert (f"{PARTITION}/nacks/1".encode(), None) in after
    assert fresh.manifest(100).buckets == (3,)
    assert NackJournal.unusable(PARTITION, None).manifest(0).next_bucket_id == 1


def test_one_offsets_subscriptions_split_over_two_chunks_are_each_found() -> None:
    """A cancel indexes one acceptance per subscription at its offset; a chunk may end among them."""
    saved, journal_module.CHUNK_BYTES = journal_module.CHUNK_BYTES, 300
    try:
        journal = NackJournal(PARTITION)
        subs = ["a", "b", "c", "d"]
        journal.write([((9, sub), accepted(sub, 9).encode()) for sub in subs], [])
        assert journal.live() == (1, 2)  # two lines a chunk
        _, after = journal.write([], [(9, "c"), (9, "a"), (9, "c")], manifest=False)
        dead = {key: BitMap.deserialize(value) for key, value in after if value is not None}
        assert dead == {
            f"{PARTITION}/nacks/1/dead".encode(): BitMap([0]),
            f"{PARTITION}/nacks/2/dead".encode(): BitMap([0]),
        }
    finally:
        journal_module.CHUNK_BYTES = saved
