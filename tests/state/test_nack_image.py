"""A control partition's nacks in the state topic, without Kafka.

The property: whatever a sidecar did with its nacks (accepted, superseded, accepted twice,
redelivered, checkpointed in either mode), a new owner that loads the nacks from the state topic
and reads the control log again from the manifest's tail redelivers exactly what one that reads
the whole control log again from the earliest pending nack would (the path without a state topic),
and so does an owner after it, once the first has checkpointed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.clock import ManualClock
from sidecar.control.commands import AcceptedNack, NackCommand
from sidecar.control.nacks import LatestNacks
from sidecar.state.image import ImageError, Manifest, Record, image_of, manifest_key, nack_records
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

    def checkpoint(self, topic: list[Record], fails: bool) -> None:
        """StateTopic._publish_nacks, then the commit, unless the owner crashes in between."""
        through = self.tracker.delivered_through()
        covered = through if self.exact else (self.commit[1] if self.commit else NOTHING_DELIVERED)
        pending, dead = self.nacks.take(CONTROL, covered)
        if pending or dead or not self.published:
            records, tombstones = nack_records(PARTITION, pending, dead)
            manifest = Manifest((), 1, self.cursor, self.cursor)
            written = [*records, (manifest_key(PARTITION), manifest.encode()), *tombstones]
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
            pending, covered = image.nacks(through)
            for offset, nack in pending:
                owner.tracker.add(offset, nack.deliver_at, deliver_now=False)
                owner.nacks.restore(nack, offset)
            owner.nacks.drop_later(CONTROL, covered)
            start = max(earliest, min(manifest.tail, committed))
            owner.published = True
    owner.cursor = start
    owner.read(log, committed, replay_until=committed, through=through)
    owner.read(log, len(log), hold=True)  # (when a record read live goes out is timing, not state)
    return owner


@pytest.mark.parametrize("exact", [False, True], ids=["at-least-once", "exactly-once"])
@settings(max_examples=400)
@given(script=ops)
def test_nacks_from_the_state_topic_plus_the_tail_are_the_nacks_of_a_full_replay(
    exact: bool, script: list[tuple[str, int, int]]
) -> None:
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
        elif op == "checkpoint":
            owner.checkpoint(topic, fails=bool(a))
            if a:
                break  # the engine starts again: a new owner takes over from the commit
        owner.read(log, len(log))
        owner.deliver(log)
    if owner.commit is None:
        return
    replayed = take_over(clock, exact, log, owner.commit, None)
    restored = take_over(clock, exact, log, owner.commit, topic)
    restored.checkpoint(topic, fails=True)  # its changes written, the commit unchanged
    again = take_over(clock, exact, log, owner.commit, topic)
    for new_owner in (replayed, restored, again):
        new_owner.deliver(log, until_ms=FAR)
    if not any(op == "twice" for op, _, _ in script):
        assert restored.redelivered == replayed.redelivered
        assert again.redelivered == replayed.redelivered
    # An acceptance written twice (at least once: a crash before its command's commit) is
    # redelivered twice by any owner that reads the copy after the first was settled; a full replay
    # may also redeliver a copy a restore knows to be dead. Which nacks come back is the same.
    before = {log[o].source for o in owner.redelivered if pack(log[o].deliver_at, o) <= owner.commit[1]}
    expected = before | {log[o].source for o in replayed.redelivered}
    for new_owner in (restored, again):
        assert before | {log[o].source for o in new_owner.redelivered} == expected


def test_an_unreadable_nack_entry_is_an_image_error() -> None:
    image = image_of(PARTITION, [(f"{PARTITION}/nack/7".encode(), b"{not json")])
    with pytest.raises(ImageError, match="offset 7"):
        image.nacks(-1)
    image = image_of(PARTITION, [(f"{PARTITION}/nack/x".encode(), b"{}")])
    with pytest.raises(ImageError, match="names no offset"):
        image.nacks(-1)


def test_two_subscriptions_nacks_at_one_offset_are_both_restored_and_old_keys_still_read() -> None:
    billing, fraud = (AcceptedNack(NackCommand(s, "t", 0, 1, None, 5_000, 0), 5_000, (*CONTROL, 9)) for s in "bf")
    records, _ = nack_records(PARTITION, [((9, "b"), billing.encode()), ((9, "f"), fraud.encode())], [])
    old = (f"{PARTITION}/nack/4".encode(), AcceptedNack(billing.command, 10, (*CONTROL, 4)).encode())
    image = image_of(PARTITION, [*records, old])
    pending, covered = image.nacks(pack(10, 4))
    assert pending == [(9, billing), (9, fraud)]
    assert covered == [(4, "")]  # named by its offset alone: its tombstone is the key it was written at
    assert nack_records(PARTITION, [], covered) == ([], [(old[0], None)])
