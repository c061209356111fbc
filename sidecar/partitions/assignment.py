"""The partitions this member owns, kept in step with the consumer group's rebalances."""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from confluent_kafka import Consumer, KafkaException, TopicPartition

from sidecar.broker.admin import committed_offsets
from sidecar.errors import BrokerError, ConfigError, SidecarError
from sidecar.partitions.metadata import CommitMetadata
from sidecar.partitions.state import PartitionState, Restore
from sidecar.policy.routes import IntakeRule
from sidecar.tracker.base import DelayedDeliveryTracker

logger = logging.getLogger(__name__)

MAX_FENCE_ROUNDS = 5
# How long the commits of newly assigned partitions are asked for, and asked again while the coordinator moves.
COMMITS_TIMEOUT_S = 30.0


class Assignment:
    """The partitions this member owns, kept in step with the group's rebalances.

    `on_assign` opens each partition's tracker and seeks to where `PartitionState.start` says.
    `on_revoke` checkpoints first (the partition goes to another member with nothing left
    uncommitted); `on_lost` cannot (another member may own it already). Exactly once, it aborts the
    open transaction and has the engine start again from the last commit; at least once, it sets
    the partitions aside until the group gives them back (`_keep`).
    """

    def __init__(
        self,
        tracker_factory: Callable[[str, int], DelayedDeliveryTracker],
        is_control: Callable[[str], bool],
        checkpoint: Callable[[], None],
        forget: Callable[[PartitionState], None],
        drop_unsent: Callable[[], None] = lambda: None,
        *,
        exact: bool = False,
        end_of: Callable[[str, int], int],
        incremental: bool = False,
        on_handoff: Callable[[str, int, int], None] | None = None,
        restore: Restore | None = None,
        fence: Callable[[str], bool] | None = None,
        last_commits: Callable[[list[TopicPartition], float], list[TopicPartition]] | None = None,
        load_rules: Callable[[str, str], tuple[tuple[int, IntakeRule], ...] | None] | None = None,
        current: Callable[[Consumer], bool] = lambda consumer: True,
    ) -> None:
        """`fence`: exactly-once mode, called with the transactional.id of each assigned partition's
        last commit, before the partition is read (a zombie of this identity must not commit); True
        when it fenced that producer now, False when it was fenced before or is not this identity's.
        `last_commits`: with `fence`, the group's commits as they stand, without waiting for a
        transaction that holds newer ones (TopicAdmin.last_commits): their producers are fenced first.
        `current`: whether a callback's consumer is the group's of the moment; one closing after it
        was made again (inbound/member.py) revokes what is kept already, on a thread of its own."""
        self.states: dict[tuple[str, int], PartitionState] = {}
        self.kept: dict[tuple[str, int], PartitionState] = {}
        """At least once: partitions lost to the group, until it assigns them again (`_keep`)."""
        self._end_of = end_of
        """A partition's end now, open transactions included (TopicAdmin.end_offset): every fact an
        earlier owner wrote lies below it. A read_committed consumer's own end, the last stable offset,
        lies below the facts of a transaction that an earlier owner's commit is still closing (a
        cancelled record was then delivered; docs/reliability.md)."""
        self._fence = fence
        self._last_commits = last_commits
        self._load_rules = load_rules
        """The whole rule history a commit's `rules_ref` names, from the state topic (None: not found)."""
        self._restore = restore
        self._drop_unsent = drop_unsent
        """Exactly once, called when partitions are lost: the writer aborts the open transaction."""
        self._exact = exact
        self.error: Exception | None = None
        """Why the engine must start again, found in a callback: raised from there, an exception
        would reach librdkafka's C code and come out of poll as a bare SystemError."""
        self._factory = tracker_factory
        self._is_control = is_control
        self._checkpoint = checkpoint
        self._forget = forget
        self._incremental = incremental
        self._on_handoff = on_handoff
        """Told (event, partitions moved, partitions owned) after each change, for the metrics."""
        """cooperative-sticky: callbacks name only the partitions that change; otherwise all of them."""
        self.failed = False
        """Set after a failure: nothing more may be committed, so revokes do not checkpoint."""
        self._current = current
        self.assigned = threading.Event()
        self.assignments = 0
        """Assignments the group has given this member so far (partitions/coverage.py counts them)."""

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if not self._current(consumer):
            return
        starts = []
        assigned: list[PartitionState] = []
        try:
            commits = self._commits(consumer, partitions)
        except KafkaException as e:  # raised by the engine after poll, not into librdkafka (see `error`)
            # Seen when a rebalance reached a member inside its close(): the handle was being destroyed.
            self.failed = True
            self.error = BrokerError(
                f"reading the commits of the assigned partitions failed ({e.args[0]}); "
                "the engine starts again from the last commit"
            )
            return
        kept, self.kept = self.kept, {}
        for tp, commit in commits:
            key = (tp.topic, tp.partition)
            committed = tp.offset if tp.offset >= 0 else None
            metadata = commit if commit.rules_ref is None else self._full_rules(f"{tp.topic}/{tp.partition}", commit)
            back = kept.pop(key, None)
            if back is not None and back.next_offset is not None and _unchanged(back, committed, metadata):
                # Lost and given back with nobody's commit since: what this member knew holds, the
                # deliveries it made since its last commit included. Starting from the commit would
                # send those again (issue 48: 4,019 of 5,000 records twice after a broker restart).
                self.states[key] = back
                assigned.append(back)
                starts.append(TopicPartition(tp.topic, tp.partition, back.next_offset))
                logger.info("partition back as this member left it partition=%s offset=%d", back.name, back.next_offset)
                continue
            if back is not None:
                self._close(back)
            state = self.states.get(key)
            if state is None:
                tracker = self._factory(tp.topic, tp.partition)
                control = self._is_control(tp.topic)
                state = PartitionState(tp.topic, tp.partition, tracker, control=control, exact=self._exact)
                self.states[key] = state
            start = state.start(committed, metadata, self._restore)
            if metadata.commands and not state.control:
                try:
                    state.hold_until, state.held_since = self._end_of(tp.topic, tp.partition), time.monotonic()
                    logger.info(
                        "partition held until its facts are read partition=%s until=%d", state.name, state.hold_until
                    )
                except SidecarError as e:  # raised by the engine after poll, not into librdkafka
                    self.failed, self.error = True, e
            assigned.append(state)
            starts.append(TopicPartition(tp.topic, tp.partition, start if start is not None else tp.offset))
        for state in kept.values():  # lost, and now another member's
            self._close(state)
        if self._incremental:
            consumer.incremental_assign(starts)
        else:
            consumer.assign(starts)
        if starts:
            # librdkafka keeps a partition paused across a revoke and a new assignment: whoever paused
            # it (IdleFetch, a removed topic's drain) lost track of it with the revoke. What holds is
            # the resume as it leaves (`_release`): this one can be lost (see there), a second chance.
            consumer.resume(starts)
        self.assigned.set()
        self.assignments += 1
        self._handoff("assigned", len(starts))
        logger.info("partitions assigned partitions=%s", _names(starts))
        if self._exact and not self.failed:
            # Exactly once: before this producer writes for them, the commits of the new partitions
            # name it, so that a successor of this identity fences it (identity.py). Only their last
            # commit again: the engine sets some of them up after this (a removed topic's drain).
            for state in assigned:
                state.claiming = True
            try:
                self._checkpoint()
            except Exception as e:  # raised by the engine after poll, not into librdkafka
                self.failed, self.error = True, e
            finally:
                for state in assigned:
                    state.claiming = False

    def _commits(
        self, consumer: Consumer, partitions: list[TopicPartition]
    ) -> list[tuple[TopicPartition, CommitMetadata]]:
        """The partitions' commits with their metadata, read again after fencing the producers they
        name until they name none left to fence. A zombie keeps committing until its fence, so the
        commit read before it may be stale, and starting from that one delivers the zombie's last
        transactions twice. The first producers fenced are those of the last commits as they stand:
        a zombie stopped inside its commit holds newer ones in its transaction, and the stable read
        waits for that transaction, which ends with the fence (TopicAdmin.last_commits)."""

        def stable() -> list[tuple[TopicPartition, CommitMetadata]]:
            return _decoded(committed_offsets(consumer, partitions, COMMITS_TIMEOUT_S))

        if self._fence is None or self.error is not None:
            return stable()
        settled = self._last_commits is None
        found = stable() if self._last_commits is None else _decoded(self._last_commits(partitions, COMMITS_TIMEOUT_S))
        for _ in range(MAX_FENCE_ROUNDS):
            named = {metadata.producer for _, metadata in found}
            fenced_now = False
            try:
                for producer in sorted(p for p in named if p is not None):
                    fenced_now |= self._fence(producer)
            except SidecarError as e:  # raised by the engine after poll, not into librdkafka
                self.failed, self.error = True, e
                return found
            if settled and not fenced_now:
                return found
            found, settled = stable(), True
        self.failed = True
        self.error = ConfigError(
            f"the commits kept naming new producers of this identity through {MAX_FENCE_ROUNDS} fences: another "
            "live sidecar runs with this --instance-id. Give each sidecar its own --instance-id"
        )
        return found

    def _full_rules(self, name: str, metadata: CommitMetadata) -> CommitMetadata:
        ref = metadata.rules_ref
        rules = self._load_rules(name, ref) if self._load_rules is not None and ref is not None else None
        if rules is None:
            logger.error(
                "the rule history named by the commit is not in the state topic; records older than the "
                "newest rules kept in the metadata are judged with the oldest of them partition=%s rules_ref=%s "
                "rules_kept=%d",
                name,
                ref,
                len(metadata.rules),
            )
            return metadata
        return replace(metadata, rules=rules)

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if not self._current(consumer):  # a closing consumer's last word: what it had is kept already
            _release(consumer, partitions)
            return
        if not self.failed:
            try:
                self._checkpoint()
            except Exception as e:  # a fenced producer, a broker gone: the engine raises it after poll
                self.failed, self.error = True, e
        _release(consumer, partitions)
        self._drop(partitions)
        self._handoff("revoked", len(partitions))
        logger.info("partitions revoked partitions=%s", _names(partitions))

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if not self._current(consumer):
            _release(consumer, partitions)
            return
        if not self._exact:
            self._keep(consumer, partitions)
            return
        # Exactly once: another member may own them already, and the open transaction also holds pops
        # of the partitions this member keeps, undone only by aborting it and starting from the commit.
        self._drop_unsent()
        self.failed = True
        self.error = BrokerError(
            "partitions were lost to the group (this member was away longer than the session timeout); "
            "the open transaction was aborted and the engine starts again from the last checkpoint"
        )
        _release(consumer, partitions)
        self._drop(partitions)
        self._handoff("lost", len(partitions))
        logger.warning("partitions lost partitions=%s", _names(partitions))

    def set_aside(self, consumer: Consumer) -> None:
        """At least once, before the member's consumer is made again (inbound/member.py): every
        partition is kept as a lost one is, for the new consumer's assignment to take up."""
        if self.states:
            self._keep(consumer, [TopicPartition(topic, partition) for topic, partition in self.states])

    def _keep(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """At least once: lost partitions are set aside as they are, neither delivered from nor
        committed, with what the writer queued for them. The group most often gives them back to this
        member, with its commit unchanged, once the broker answers again (`on_assign` takes them up
        where they were); given to another member, they are closed at the next assignment, and what
        they had queued reaches the broker beside that member's copies: repeats of what this member
        wrote since its last commit, which at least once allows (docs/contract.md)."""
        for tp in partitions:
            state = self.states.pop((tp.topic, tp.partition), None)
            if state is None:
                continue
            if state.drain_from is not None:
                # A removed topic's drain would go on dead-lettering a partition another member may
                # own already: it stops, and whoever is given the partition resumes it from its commit.
                self._close(state)
            else:
                self.kept[(tp.topic, tp.partition)] = state
        _release(consumer, partitions)
        self._handoff("lost", len(partitions))
        logger.warning(
            "partitions lost; kept as they are until the group assigns them again partitions=%s", _names(partitions)
        )

    def _close(self, state: PartitionState) -> None:
        self._forget(state)
        state.tracker.close()

    def _handoff(self, event: str, moved: int) -> None:
        if self._on_handoff is not None:
            self._on_handoff(event, moved, len(self.states))

    def _drop(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            state = self.states.pop((tp.topic, tp.partition), None)
            if state is not None:
                self._close(state)

    def close_kept(self) -> None:
        """The engine stops: partitions lost and not given back are closed."""
        kept, self.kept = self.kept, {}
        for state in kept.values():
            self._close(state)


def _unchanged(state: PartitionState, committed: int | None, metadata: CommitMetadata) -> bool:
    """The group's commit is the last one `state` made or started from, or the one it sent and
    never heard back of: no member committed since."""
    found = metadata.fingerprint_at(committed)
    if found == state.committed_fingerprint:
        return True
    if state.sent_fingerprint is None or found != state.sent_fingerprint or committed is None:
        return False
    state.committed, state.committed_fingerprint = (committed, metadata.encode()), found
    return True


def _release(consumer: Consumer, partitions: list[TopicPartition]) -> None:
    """Resume the partitions leaving this member, whoever paused them (IdleFetch, a removed topic's
    drain). librdkafka keeps a partition paused through an unassign and a later assign, and a resume
    sent around an assignment can be lost in a race with the assignment's own operations (reported
    as librdkafka#5591; not reproduced here): the partition then stays paused with nobody to resume
    it, and its records are never read. Resumed while still assigned, it is not paused when it comes
    back, whatever happens to the resume that `on_assign` sends."""
    if not partitions:
        return
    try:
        consumer.resume(partitions)
    except KafkaException as e:  # the consumer is closing: nothing comes back to this handle
        logger.debug("leaving partitions not resumed partitions=%s error=%s", _names(partitions), e)


def _decoded(commits: list[TopicPartition]) -> list[tuple[TopicPartition, CommitMetadata]]:
    return [(tp, CommitMetadata.decode(tp.metadata)) for tp in commits]


def _names(partitions: list[TopicPartition]) -> str:
    return ",".join(f"{tp.topic}/{tp.partition}" for tp in partitions) or "-"
