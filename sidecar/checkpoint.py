"""The checkpoint: the one place where progress becomes durable, in a fixed order.

1. Flush the producer. Every outbound, dead-letter and accepted-nack record written so far is
   acknowledged by the broker, or nothing below is done: the checkpoint fails, or at least once a
   periodic one is put off to the next (the broker away; the engine goes on with what it knows).
2. Checkpoint each tracker at its partition's next offset. The bucket tracker writes its adds
   and pops to RocksDB in one batch, without waiting for the disk; the in-memory tracker has
   nothing to write. Then one fsync makes all of them durable (the trackers share one store).
3. Commit, for each partition whose position or metadata changed, the next offset to read with
   the metadata (earliest pending offset, delivered watermark, intake rules). A partition whose
   tracker could not make itself durable up to that offset is not committed this time.

2b. With a state topic (state/topic.py), write each partition's new bucket snapshots and its
   manifest there. They are not waited for: a manifest that trails the commit is still right,
   only more of the log is read again at a handoff. In exactly-once mode they are part of the
   transaction that step 3 commits. (A control partition's nacks are also written between
   checkpoints, once a thousand wait: `journal`. A checkpoint a second into a burst of nacks
   spent 50 to 200 ms on them.)

2c. A partition whose intake-rule history does not fit in Kafka's commit metadata has the whole
   history written to the state topic, and acknowledged (or in the transaction) before the commit
   whose metadata names it (`rules_ref`). Without a state topic the oldest rules are dropped, with
   an error in the log.

At least once, the fsync runs in a thread beside the loop, and step 3 waits for it: the loop goes
on delivering, and the commit is made at the first turn after the fsync returned (`settle`). An
fsync waited for on the loop held up deliveries for 0.1 to 0.9 s at a time when the disk was busy.
A checkpoint that must be whole before the caller goes on (a revoke, a stop, a removed topic)
waits for both. A pending commit is dropped for a partition no longer assigned. A failed fsync
commits nothing; the next checkpoint tries again. An fsync slower than the commit interval puts
the next checkpoint off until it has returned, rather than holding up the loop.

At least once: a crash between 2 and 3 leaves local state one checkpoint ahead of Kafka; the
restart uses it (PartitionState.start), since everything it covers was acknowledged in step 1.
Deliveries alone change the watermark, so a checkpoint commits after deliveries even when nothing
new was read.

Exactly once: step 3 is the commit of the transaction that holds every record written since the
last checkpoint, with the offsets and metadata sent into it (KIP-447). The records and the commit
become visible together or not at all, so the fsync is waited for on the loop, before the
transaction commits. A crash between 2 and 3 aborts the records, and the local state written in 2
is ahead of the truth: the restart does not use it (PartitionState.start
requires local state to match the commit exactly). Every partition is committed at its next
offset, a degraded index included: the records it delivered are in this transaction, and its
local state is simply rebuilt from the commit after a crash.
"""

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from sidecar.broker.admin import COORDINATOR_MOVING, while_coordinator_moves
from sidecar.errors import BrokerError, SidecarError, StorageError
from sidecar.inbound.member import GroupMember
from sidecar.metrics import BucketMetrics
from sidecar.outbound.writer import Writer
from sidecar.partitions.state import PartitionState
from sidecar.state.topic import StateTopic

logger = logging.getLogger(__name__)

Points = list[tuple[PartitionState, tuple[int, str], str | None]]
"""(partition, (offset, metadata) to commit, its fingerprint; None for a claim, which changes none)."""
# How long an at-least-once commit is asked again while the group's coordinator moves; then it is
# put off to the next checkpoint.
COMMIT_RETRY_S = 10.0
COORDINATOR_AWAY = COORDINATOR_MOVING | {KafkaError._TRANSPORT}
# A periodic commit refused because the group moved on (a rebalance, or the member's session over):
# librdkafka rejoins and hands the partitions over as lost, and whoever owns them next starts from
# the last commit; starting the engine again here only repeated what was acknowledged since (CI,
# noida-db, a broker restarted twice in 4 s: 544 of 6,000 records).
GROUP_MOVED_ON = {KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS}
# How long the answer to a commit is waited for once the consumer failed for good (`fenced_by_own_lapse`).
OWN_FENCE_WAIT_S = 2.0
# How long a periodic at-least-once checkpoint waits for the writer's acknowledgements before it is
# put off to the next: the loop is blocked meanwhile, and the broker may be away for minutes.
PUT_OFF_AFTER_S = 5.0
# How long the writer may be without a producer id while the brokers answer before the engine starts
# again with a new one (librdkafka gets one in a second or two, a few more after a broker restart).
WITHOUT_ID_S = 30.0


@dataclass
class _Flight:
    """At least once: a periodic commit sent asynchronously and not answered yet.

    librdkafka's synchronous commit, waiting on a thread of its own for a coordinator that stopped
    answering (a node paused, or going down as the commit left), held the loop's next consume as
    long as it waited, whatever its timeout: the loop stopped, and with it the handling of the
    partitions lost when the session timed out (CI: a broker away 120 s and nothing logged). An
    asynchronous commit is answered through `on_commit`, at a later poll of the loop's own.
    """

    points: Points
    sent: dict[tuple[str, int], tuple[int, str]]
    """What it commits, by partition: how its answer is told from another's."""
    before: list[tuple[int, str] | None]
    """Each point's partition's commit as it was sent: a commit made since (a whole checkpoint's) is newer."""
    member: str
    """The member id it was sent under."""
    at: float


class Checkpoints:
    """Runs the checkpoints of one engine, and holds the commit that waits for the index's fsync."""

    def __init__(
        self,
        writer: Writer,
        member: GroupMember,
        state_topic: StateTopic | None,
        sync: Callable[[], None] | None,
        ops: BucketMetrics,
        reachable: Callable[[], bool] = lambda: True,
        landed: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`sync`: makes the trackers' writes durable (the snapshot store's), None without one.
        `reachable`: whether the brokers answer (kafka_io.Connectivity); while they are away no
        periodic commit is asked for. `landed`: told of each periodic commit the coordinator accepted.
        `clock`: monotonic seconds."""
        self._writer = writer
        self._member = member
        self._state_topic = state_topic
        self._sync = sync
        self._ops = ops
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="index-sync") if sync is not None else None
        self._pending: tuple[Future[bool], Points] | None = None
        self._flight: _Flight | None = None
        self._landed = landed
        self.error: BrokerError | None = None
        """A periodic commit refused for a reason other than the coordinator's absence: raised by the
        engine after poll (`on_commit` runs inside it, where an exception would reach librdkafka)."""
        self.fenced_after_lapse = False
        """A periodic commit was refused FENCED_INSTANCE_ID after this member's session lapsed."""
        self._whole = False
        """In a whole checkpoint (a revoke, a stop): the commit is made on the calling thread and
        waited for, as the partitions must not change hands before it; periodic ones are bounded."""
        self.put_off = False
        """The last checkpoint was put off: the writer's records were not acknowledged in time."""
        self._reachable = reachable
        self._clock = clock
        self._away_at = clock()
        """When a periodic checkpoint last found the brokers away (or this one began): no producer
        gets an id while they are, so a wedged producer is only told from their return."""

    def run(self, states: Iterable[PartitionState], whole: bool = True) -> int:
        """Run one checkpoint; returns the number of partitions committed.

        `whole=False` (at least once): return once the commit waits only for the index's fsync,
        which `settle` then commits; a pending commit of the checkpoint before is made first.
        """
        states = list(states)
        self._whole = whole
        try:
            return self._run(states, whole)
        finally:
            self._whole = False

    def _run(self, states: list[PartitionState], whole: bool) -> int:
        self.put_off = False
        writer = self._writer
        exact = writer.transactional
        if not (exact or whole or self._reachable()):
            # At least once, the brokers away: librdkafka's synchronous commit, asked for while no
            # coordinator is known, waits for one with no timeout, and held the loop until the
            # session timed out; then it failed (_WAIT_COORD) and the engine started again from its
            # last commit. The next checkpoint commits as much and more. (An asynchronous commit was
            # tried: refused ILLEGAL_GENERATION in a rebalance on noida-db, it made librdkafka drop
            # the assignment as lost, and the member that took a partition repeated it from the
            # commit before.)
            self.put_off = True
            self._away_at = self._clock()
            return 0
        committed = self.settle(states, wait=True)
        if exact or whole:
            writer.flush()
        elif not writer.acknowledged(PUT_OFF_AFTER_S):
            # At least once, the broker away: nothing is committed this time, and the engine goes on
            # with what it knows. Failing here started it again from the last commit, and everything
            # acknowledged since went out a second time.
            logger.warning(
                "checkpoint put off: records not acknowledged yet unacknowledged=%d %s",
                len(writer.producer),
                writer.describe(),
            )
            self.put_off = True
            self._replace_a_wedged_writer()
            return committed
        points: Points = []
        claims: Points = []
        state_topic = self._state_topic
        for state in states:
            if state.claiming:
                # Just assigned, not set up yet: only its last commit again, naming this producer.
                claim = state.claim_point(writer.transactional_id) if writer.transactional_id is not None else None
                if claim is not None:
                    claims.append((state, claim, None))
                continue
            if state.next_offset is None or state.rebuild is not None:
                continue  # nothing read yet, or a rebuild that a crash would simply start again
            if state.held_requests:
                # Requests set aside until the hold ends are not decided yet: a commit past them, then
                # a crash or a fence before the hold's end, and nobody would read them again (CI, the
                # chaos test: a cancel never answered, its request committed past by a periodic
                # checkpoint during the hold, its decision in a transaction the fence aborted).
                continue
            tracker = state.tracker
            point = state.commit_point(tracker.earliest_pending_offset(), exact, writer.transactional_id)
            # A draining partition's index was cleared and stays so: a local index "complete and
            # empty" would hide from a restart the records its commit still says are pending.
            if state.drain_from is None:
                tracker.checkpoint(state.next_offset, state.lineage, state.point_rules)
                if not exact and tracker.durable and tracker.index_cursor() != state.next_offset:
                    point = None  # the index is not durable up to here: the commit must not pass it
            if state_topic is not None:
                state_topic.publish(state)
            if point is not None:
                points.append((state, point, state.lineage[0]))
        if _rule_histories(points, state_topic) and not exact:
            writer.flush()  # at least once: a history is acknowledged before a commit names it
        if not points and not exact:
            return committed
        points += claims
        if self._pool is None:
            return committed + self._commit(points)
        if exact:
            # A failure is logged and the transaction commits anyway: a restart uses local state only
            # when it matches the commit exactly, and otherwise rebuilds it.
            self._sync_index()
            return committed + self._commit(points)
        self._pending = (self._pool.submit(self._sync_index), points)
        return committed + (self.settle(states, wait=True) if whole else 0)

    def journal(self, state: PartitionState | None) -> None:
        """Between checkpoints, a control partition that just took commands writes its new nacks to
        the state topic once enough wait, so no checkpoint writes a burst's worth at once."""
        if self._state_topic is not None and state is not None and state.control:
            self._state_topic.journal(state)

    @property
    def syncing(self) -> bool:
        """An fsync is still running: the next checkpoint waits (the loop goes on meanwhile)."""
        return self._pending is not None and not self._pending[0].done()

    def _replace_a_wedged_writer(self) -> None:
        """BrokerError when the writer has been without a producer id for WITHOUT_ID_S while the
        brokers answered: librdkafka is not getting it one, and only a new producer (an engine
        restart, from the last commit) sends its records before message.timeout.ms fails them.
        Nothing this producer sent since it lost its id was acknowledged, so the restart repeats only
        what was acknowledged before, since the last commit; while the brokers are away nobody is
        replaced."""
        wedged = min(self._writer.without_id_s(), self._clock() - self._away_at)
        if wedged >= WITHOUT_ID_S:
            raise BrokerError(
                f"the producer has had no producer id for {wedged:.0f} s while the brokers answer (librdkafka "
                f"state {self._writer.id_state}); the engine starts again from the last checkpoint with a new "
                "producer. If this repeats, check that the brokers can allocate producer ids (the controller quorum)"
            )

    def settle(self, states: Iterable[PartitionState], wait: bool = False) -> int:
        """Commit what the last checkpoint left waiting for the fsync, once it has returned (at
        once with `wait`), for the partitions among `states`; returns how many were committed."""
        pending = self._pending
        if pending is None or not (wait or pending[0].done()):
            return 0
        if not (wait or self._reachable()):
            return 0  # the brokers away: committed once they are back, or by a whole checkpoint (see `run`)
        self._pending = None
        future, points = pending
        if not future.result():
            return 0
        owned = {id(state) for state in states}
        points = [entry for entry in points if id(entry[0]) in owned]
        return self._commit(points) if points else 0

    def close(self) -> None:
        """Wait for a running fsync (the store closes after the engine); its commit is dropped. A
        commit still unanswered is not waited for: closing the consumer ends it."""
        self._pending = None
        self._flight = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _sync_index(self) -> bool:
        """The fsync, counted and timed as the trackers' storage operations are; False (logged) when it failed."""
        assert self._sync is not None
        started = time.monotonic()
        try:
            self._sync()
        except StorageError as e:
            self._ops.on_op("sync", False, time.monotonic() - started)
            # At least once nothing is committed until an fsync succeeds; exactly once the transaction
            # commits, and a restart rebuilds an index that is behind it.
            logger.error("index fsync failed exactly_once=%s error=%s", self._writer.transactional, e)
            return False
        self._ops.on_op("sync", True, time.monotonic() - started)
        return True

    def _commit(self, points: Points) -> int:
        writer = self._writer
        offsets = [TopicPartition(s.topic, s.partition, offset, metadata=meta) for s, (offset, meta), _ in points]
        try:
            if writer.transactional:
                writer.commit(offsets, self._member.consumer.consumer_group_metadata())
            elif not self._member.consumer.memberid():
                # The client timed its group session out (no heartbeat answered for session.timeout.ms,
                # as across two outages close together) and reset its member id: its lost partitions
                # reach the engine at the next poll. A static member's commit with no member id is
                # refused FENCED_INSTANCE_ID, which librdkafka makes fatal, and the engine started
                # again from its last commit (CI: a record repeated after two broker restarts). The
                # group gives the partitions back, and the next checkpoint commits as much and more.
                logger.warning("commit put off: this member's group session lapsed; waiting to be assigned again")
                self.put_off = True
                return 0
            elif self._whole:
                # A whole checkpoint (a revoke, a stop) commits on the calling thread, as the rebalance
                # callback's own: handed to another thread from inside the callback, the commit waited
                # on the rebalance that waited on it (CI: a live topic removal's re-subscription held
                # the loop, and the stop, for good). A periodic commit still unanswered goes first on
                # the same connection.
                consumer = self._member.consumer
                while_coordinator_moves(
                    lambda: consumer.commit(offsets=offsets, asynchronous=False), COMMIT_RETRY_S, "commit"
                )
            elif self._flight is not None:
                waited = time.monotonic() - self._flight.at
                logger.warning(
                    "commit put off: the group coordinator has not answered the one before waited_s=%.0f", waited
                )
                self.put_off = True
                return 0
            else:
                consumer = self._member.consumer
                self._flight = _Flight(
                    points,
                    _sent(offsets),
                    [state.committed for state, _, _ in points],
                    consumer.memberid() or "",
                    time.monotonic(),
                )
                try:
                    consumer.commit(offsets=offsets, asynchronous=True)
                except BaseException:
                    self._flight = None
                    raise
                for state, _, fingerprint in points:
                    state.sent_fingerprint = fingerprint
                return 0
        except SidecarError:
            raise
        except KafkaException as e:
            if writer.transactional or e.args[0].code() not in COORDINATOR_AWAY:
                raise _failed(e) from e
            # At least once, the coordinator still away: the next checkpoint commits as much and more.
            # A restart here would send again everything acknowledged since the last commit.
            logger.warning("commit put off: the group coordinator does not answer error=%s", e.args[0])
            self.put_off = True
            return 0
        except Exception as e:
            raise _failed(e) from e
        _committed(points)
        return len(points)

    @property
    def in_flight(self) -> bool:
        """A periodic commit is sent and not answered yet."""
        return self._flight is not None

    def fenced_by_own_lapse(self) -> bool:
        """At least once, the consumer's fatal error is the fence of a commit it sent after its
        session lapsed (inbound/member.py). The commit's answer can come at a poll after the error."""
        if self._writer.transactional:
            return False
        deadline = time.monotonic() + OWN_FENCE_WAIT_S
        while self._flight is not None and time.monotonic() < deadline:
            self._member.consumer.poll(0.1)  # a record it returns is read again by the next consumer
        return self.fenced_after_lapse

    def member_renewed(self) -> None:
        """The group member's consumer was made again: what the old one held to commit went with
        it. Whether it landed is left to the partitions' return (`sent_fingerprint`)."""
        self._flight = None
        self.fenced_after_lapse = False

    def on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """The coordinator's answer to an asynchronous commit, served by a poll on the loop's thread.
        Never raises: it runs inside librdkafka's callback (see `error`)."""
        try:
            self._answered(error, partitions)
        except Exception as e:
            self.error = _failed(e)

    def _answered(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        flight = self._flight
        if flight is None or _sent(partitions) != flight.sent:
            return  # dropped at a close, or not one of ours
        self._flight = None
        refused = {(tp.topic, tp.partition): tp.error for tp in partitions if tp.error is not None}
        landed = [
            entry
            for entry, before in zip(flight.points, flight.before, strict=True)
            if error is None and (entry[0].topic, entry[0].partition) not in refused and entry[0].committed is before
        ]
        _committed(landed)
        for state, _, _ in landed:
            state.sent_fingerprint = None  # a refused one may still have landed (a timeout): kept
        if error is None and not refused:
            self._landed()
            return
        cause: KafkaError = error if error is not None else next(iter(refused.values()))
        code = cause.code()
        if code == KafkaError.FENCED_INSTANCE_ID and (self._member.consumer.memberid() or "") != flight.member:
            # librdkafka held the commit while no coordinator answered and sent it after the session
            # timed out, under the member id it then had: none, or the new one of the member's own
            # rejoin. The fence is this member's own; librdkafka makes it fatal all the same.
            logger.warning(
                "commit refused: sent after this member's group session lapsed error=%s sent_as=%s",
                cause,
                flight.member,
            )
            self.fenced_after_lapse = True
        elif code in GROUP_MOVED_ON:
            logger.warning("commit not made: the group moved on; the partitions' next owner starts from the last "
                           "commit error=%s", cause)  # fmt: skip
        elif code in COORDINATOR_AWAY or code in (KafkaError._WAIT_COORD, KafkaError._TIMED_OUT):
            # The next checkpoint commits as much and more; a restart would send again everything
            # acknowledged since the last commit.
            logger.warning("commit not made: the group coordinator did not answer in time error=%s", cause)
        else:
            self.error = _failed(KafkaException(cause))


def _failed(e: Exception) -> BrokerError:
    return BrokerError(f"committing inbound offsets failed: {e}; a restart resumes at the last commit")


def _sent(offsets: list[TopicPartition]) -> dict[tuple[str, int], tuple[int, str]]:
    return {(tp.topic, tp.partition): (tp.offset, tp.metadata or "") for tp in offsets}


def _committed(points: Points) -> None:
    for state, point, fingerprint in points:
        state.committed = point
        if fingerprint is not None:
            state.committed_fingerprint = fingerprint


def _rule_histories(points: Points, state_topic: StateTopic | None) -> bool:
    """Write the rule histories the commit metadata cannot hold; True when one was written."""
    written = False
    for state, _, _ in points:
        if state_topic is not None:
            written |= state_topic.publish_rules(state)
        elif state.rules_record is not None and state.rules_record[0] not in (state.committed or (0, ""))[1]:
            logger.error(
                "intake rule history too large for the commit metadata and no state topic: the oldest rules "
                "are dropped, and a rebuild would judge the records they covered with a later rule. Run with "
                "a state topic (--state-topic) partition=%s bytes=%d",
                state.name,
                len(state.rules_record[1]),
            )
    return written
