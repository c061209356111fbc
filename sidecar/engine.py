"""The sidecar's loop, on one thread: it wires the rooms of the flow together and does nothing else.

    inbound (receiver: intake.judge) -> tracker -> dispatch -> outbound (delivery, writer)
    control (acceptance)             -> tracker -> control (redelivery) -> outbound
    checkpoint.py: flush, tracker checkpoints, commit; partitions/metadata.py: what a commit means
    state/: the state topic, where bucket snapshots go so a new owner of a partition need not
    read its whole pending range again

One thread keeps the commit rule simple to state and to check (see checkpoint.py).
"""

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, Message, TopicPartition

from sidecar.broker.admin import TopicAdmin
from sidecar.checkpoint import Checkpoints
from sidecar.clock import Clock, SystemClock
from sidecar.collector import Collector
from sidecar.control.acceptance import Acceptance
from sidecar.control.forwarding import Forwarding
from sidecar.control.intake import ControlIntake
from sidecar.control.nacks import LatestNacks
from sidecar.control.outcomes import Outcomes
from sidecar.control.overrides import Copy
from sidecar.control.redelivery import Redelivery
from sidecar.control.topics import ControlTopics, retired
from sidecar.dispatch.dispatcher import Dispatcher
from sidecar.dispatch.drain import Drains
from sidecar.dispatch.gates import KeyedGates
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.dispatch.reader import LogReader
from sidecar.dispatch.recent import RecentRecords
from sidecar.dispatch.removal import RemovedTopics
from sidecar.dispatch.roll import HorizonRoll
from sidecar.errors import BrokerError, ConsumerFailed
from sidecar.identity import TransactionalIds
from sidecar.inbound.admission import Admission
from sidecar.inbound.batch import batches
from sidecar.inbound.commands import CommandStep
from sidecar.inbound.idle_fetch import IdleFetch
from sidecar.inbound.indexing import Indexer
from sidecar.inbound.member import GroupMember, rejoin_watch
from sidecar.inbound.rebuild import Rebuilder
from sidecar.inbound.receiver import Receiver
from sidecar.kafka_io import LIBRDKAFKA, Connectivity, consume_batch, consumer_config
from sidecar.metrics import BucketMetrics, Metrics
from sidecar.outbound.delivery import Delivery
from sidecar.outbound.records import HeaderForm
from sidecar.outbound.writer import Writer
from sidecar.partitions.assignment import Assignment
from sidecar.partitions.coverage import Coverage
from sidecar.partitions.gauges import publish_due_gauges, publish_index_gauges
from sidecar.partitions.holds import Holds
from sidecar.partitions.lookup import Asked, Questions, Whereabouts
from sidecar.partitions.metadata import CommitMetadata
from sidecar.partitions.state import PartitionState
from sidecar.policy import PolicySet
from sidecar.policy.routes import Routes
from sidecar.settings import SESSION_TIMEOUT_MS
from sidecar.state.mirror import MirroredStorage
from sidecar.state.topic import StateTopic
from sidecar.tracker import DelayedDeliveryTracker
from sidecar.tracker.memory import InMemoryTracker
from sidecar.tracker.storage import SnapshotStorage

logger = logging.getLogger(__name__)

TrackerFactory = Callable[[str, int], DelayedDeliveryTracker]
# Longest the loop blocks waiting for records: bounds how late a stop request or a policy change
# is noticed. Due deliveries wake the loop earlier by shortening the wait.
MAX_WAIT_S = 0.1
# The wait reported when nothing is due at all (for the garbage collector: time for a full pass).
IDLE_WAIT_S = 60.0
# The pending-by-due-time gauges are refreshed at most this often (a pass over the index's segment tables).
DUE_GAUGES_EVERY_S = 10.0
STALL_WAIT_S = 0.05
# Inbound records judged between two looks at due deliveries: about 15 ms of intake, so a batch of
# 10,000 does not hold up a due record for the 100 ms it takes to judge.
INTAKE_SLICE = 2_000
# Control commands judged between two looks at due deliveries: a command costs ten inbound records
# or more (a JSON decode, the latest-nack table, an accepted record), and a nack that falls due
# while 2,000 of them are judged waited 250 ms for the slice to end.
CONTROL_SLICE = 250
# A loop turn normally takes milliseconds; one this long is blocked on a broker that does not answer.
STUCK_S = 15.0


class Sidecar:
    def __init__(
        self,
        client_config: dict[str, Any],
        policies: Callable[[], PolicySet],
        tracker_factory: TrackerFactory,
        group_id: str = "delay-sidecar",
        instance_id: str | None = None,
        session_timeout_ms: int = SESSION_TIMEOUT_MS,
        metrics: Metrics | None = None,
        clock: Clock | None = None,
        commit_interval_ms: int = 1000,
        batch_size: int = 10_000,
        idle_fetch_pause_ms: int = 0,
        new_topic_partitions: int = 3,
        replication_factor: int | None = None,
        control_topic: str = "delay-sidecar.control",
        read_ahead_ms: int = 10_000,
        recent_records_bytes: int = 0,
        payload_cache: PayloadCache | None = None,
        producer: dict[str, Any] | None = None,
        outbound_headers: HeaderForm = "compact",
        assignment_strategy: str = "roundrobin",
        transactional_ids: TransactionalIds | None = None,
        state_topic: str | None = None,
        index_storage: SnapshotStorage | None = None,
        state_dir: Path | None = None,
    ) -> None:
        """`transactional_ids`: exactly-once mode, where each producer's transactional.id comes from.
        `index_storage`: the bucket trackers' store, which each checkpoint syncs once. `state_topic`,
        with an `index_storage` mirrored to it: where bucket snapshots go for handoffs. `state_dir`: where
        the member remembers its subscription across restarts (partitions/coverage.py)."""
        mirror = index_storage if isinstance(index_storage, MirroredStorage) else None
        exactly_once = transactional_ids is not None
        self._policies = policies
        self.metrics = metrics = metrics or Metrics()
        self.clock = clock = clock or SystemClock()
        self._commit_interval_s = commit_interval_ms / 1000
        self._batch_size = batch_size
        self._controls = controls = ControlTopics(control_topic)
        self._group_id = group_id
        self._stop = threading.Event()
        self._routes: dict[str, Routes] = {}
        self._generation = -1
        self._subscribed: frozenset[str] = frozenset()
        self._stalled_until = 0.0
        self._due_gauges_at = 0.0
        librdkafka = LIBRDKAFKA
        self._connectivity = Connectivity()
        self._outages_seen = 0
        """Outages seen when the open transaction began (exactly-once mode)."""
        client_config = {**client_config, "error_cb": self._connectivity.on_error}
        group: dict[str, Any] = {
            "group.id": group_id,
            "session.timeout.ms": session_timeout_ms,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": assignment_strategy,
        }
        if instance_id:
            group["group.instance.id"] = instance_id
        if exactly_once:
            group["isolation.level"] = "read_committed"  # accepted nacks of aborted transactions are not ours
        if idle_fetch_pause_ms:
            group["enable.partition.eof"] = True  # what IdleFetch paces by
        group["on_commit"] = self._on_commit  # answers to the periodic commits (checkpoint.py)
        self._member = member = GroupMember(consumer_config(client_config, **group))
        self._rejoin = rejoin_watch(session_timeout_ms)
        try:  # exactly-once: fencing the earlier transactional.id fails while the brokers are away
            self._writer = writer = Writer(client_config, librdkafka, transactional_ids, producer)
        except BaseException:
            member.consumer.close()  # the engine is built again, after a pause: not one consumer per attempt
            raise
        self._admin = TopicAdmin(client_config, new_topic_partitions, replication_factor)
        self._nacks = LatestNacks(changelog=bool(state_topic and mirror))
        self._state_topic = (
            StateTopic(state_topic, client_config, self._admin, writer, mirror, self._nacks, metrics)
            if state_topic and mirror
            else None
        )
        self._checkpoints = Checkpoints(
            writer,
            member,
            self._state_topic,
            index_storage.sync if index_storage is not None else None,
            BucketMetrics(metrics),
            lambda: self._connectivity.reason is None,
            self.metrics.commits.inc,
        )
        retention = self._admin.retention_ms
        self._ahead_reader = LogReader(client_config, self._stop)
        # Due reads are never interrupted: their entries are already popped, and a stop must
        # deliver them before its final checkpoint makes the pops durable.
        self._reader = LogReader(client_config, threading.Event())

        def create_tracker(topic: str, partition: int) -> DelayedDeliveryTracker:
            # Nack indexes stay in memory: the control topic is their write-ahead log, and after a
            # restart they come from the state topic, or from the control log read again from the
            # earliest pending accepted nack (partitions/metadata.py).
            return InMemoryTracker(clock) if controls.is_control(topic) else tracker_factory(topic, partition)

        self._assignment = assignment = Assignment(
            create_tracker,
            controls.is_control,
            self._checkpoint,
            self._forget,
            writer.abort,
            exact=exactly_once,
            end_of=self._admin.end_offset,
            incremental=assignment_strategy == "cooperative-sticky",
            on_handoff=self._on_handoff,
            restore=self._restore,
            fence=self._fence_earlier if transactional_ids is not None else None,
            last_commits=partial(self._admin.last_commits, group_id),
            load_rules=self._state_topic.load_rules if self._state_topic is not None else None,
            current=member.current,
        )
        self._coverage = Coverage(state_dir, self._subscribe_to, lambda: assignment.assignments)
        self._ids = transactional_ids
        self._fenced = set(writer.fenced)
        states = assignment.states
        self._idle = IdleFetch(member, idle_fetch_pause_ms, self._paced)
        self._holds = Holds(states, self._idle.position, member, self._hold_released)
        self._delivery = Delivery(writer, states, self._current_routes, retention, metrics, clock, outbound_headers)
        self._roll_reader = LogReader(client_config, self._stop) if payload_cache is not None else None
        self._roll = (
            HorizonRoll(self._roll_reader, payload_cache, self._rejudge, clock)
            if payload_cache is not None and self._roll_reader is not None
            else None
        )
        self._drains = Drains(client_config, writer, metrics, clock, group_id)
        self._gates = KeyedGates(writer, group_id, clock)
        self._removed = RemovedTopics(
            member, states, self._drains, lambda: self._admin.partitions, self._forget_dispatch, self._restore
        )
        self._dispatcher = Dispatcher(
            self._ahead_reader,
            self._reader,
            self._delivery.delayed,
            clock,
            read_ahead_ms,
            payload_cache,
            metrics,
            self._roll,
            self._copy_origins,
        )
        outcomes = Outcomes(writer, metrics)
        forwarding = Forwarding(
            group_id,
            writer,
            self._reader,
            self._current_routes,
            outcomes,
            clock,
            controls,
            lambda: self._admin.partitions,
        )
        self._acceptance = Acceptance(
            controls, group_id, writer, self._reader, states, self._current_routes, self._nacks, metrics, clock,
            forwarding,
        )  # fmt: skip
        self._recent = RecentRecords(recent_records_bytes)
        self._redelivery = Redelivery(
            self._acceptance, writer, self._reader, self._recent, states, self._current_routes, retention,
            self._nacks, metrics, clock, outbound_headers,
        )  # fmt: skip
        indexer = Indexer(self._dispatcher, self._delivery)
        self._commands = CommandStep(group_id, writer, self._delivery, outcomes, self._reader, retention, control_topic)
        self._admission = Admission(retention, writer, self._delivery, indexer, metrics, self._commands)
        self._receiver = Receiver(
            states, batches(self._current_routes, metrics, clock, payload_cache), self._admission,
            Rebuilder(self._delivery, retention, metrics, self._commands),
            ControlIntake(self._acceptance, self._redelivery), writer.poll, self._recent.keep,
        )  # fmt: skip
        self._questions = Questions(
            states, self._current_routes, retention, self._reader.read_one, self._nacks.pending_for,
            lambda: member.consumer.memberid() or "",
        )  # fmt: skip
        self.assigned = assignment.assigned
        """Set once the group gave this member partitions: it is serving."""
        self.degraded: list[str] = []
        """Partitions whose durable index is failing and running from memory (for /healthz)."""
        self.running = False
        self._state = "starting"
        self._turned = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def where_is(self, topic: str, partition: int, asked: Asked, timeout_s: float = 10.0) -> Whereabouts:
        """GET /messages/...: asked from the HTTP thread, answered by the loop between two turns."""
        return self._questions.ask(topic, partition, asked, timeout_s)

    def _paced(self, partition: tuple[str, int]) -> bool:
        """Served, and not paused by the engine itself (a removed topic's drain): IdleFetch may pause it."""
        state = self._assignment.states.get(partition)
        return state is not None and state.drain_from is None

    def _copy_origins(self, partition: tuple[str, int]) -> Mapping[int, Copy]:
        state = self._assignment.states.get(partition)
        return state.overrides.copies if state is not None else {}

    def run(self) -> None:
        """Serve until stop() is called; raises SidecarError when the broker fails for good."""
        clean = False
        try:
            if self._state_topic is not None:
                self._state_topic.ensure()  # before the first assignment, which may read it
            self._apply(self._policies())
            self.running, self._state = True, ""
            last_checkpoint = time.monotonic()
            records: list[Message] = []
            with Collector(self._observe_collection) as collector:
                while not self._stop.is_set():
                    self._turned = time.monotonic()
                    policies = self._policies()  # one generation judges this whole batch
                    if policies.generation != self._generation:
                        self._apply(policies)
                    self._dispatch_due()  # due first: after a restart, what fell due while down goes out first
                    wait = self._wait_s()
                    collector.between_turns(wait, idle=not records)
                    wait = self._idle.wait_s(min(wait, MAX_WAIT_S))
                    records = self._idle.take(consume_batch(self._member.consumer, self._batch_size, wait))
                    self._questions.answer()
                    if self._assignment.error is not None:
                        raise self._assignment.error
                    if self._checkpoints.error is not None:
                        raise self._checkpoints.error
                    self._coverage.turn()
                    if self._removed:
                        self._removed.adopt()  # partitions of removed topics just assigned: before intake
                    try:
                        self._intake(records)
                    except ConsumerFailed:
                        if not self._checkpoints.fenced_by_own_lapse():
                            raise
                        self._renew_member("a commit sent after the session lapsed was fenced")
                    kept = bool(self._assignment.kept) and not self._writer.transactional
                    if kept and self._checkpoints.in_flight:
                        self._renew_member("partitions lost with a commit held for the coordinator")
                    elif self._rejoin.check(kept and self._connectivity.reason is None):
                        self._renew_member(
                            f"the group has not given the lost partitions back {self._rejoin.wait_s:.0f} s "
                            "after the brokers answered"
                        )
                    self._drains.turn()  # a slice of dead-lettering for removed topics
                    self._connectivity.watch(bool(records), self._admin.reachable)
                    checkpoints = self._checkpoints
                    if checkpoints.settle(self._assignment.states.values()):
                        self.metrics.commits.inc()
                    if time.monotonic() - last_checkpoint >= self._commit_interval_s and not checkpoints.syncing:
                        self._checkpoint(whole=False)  # its commit waits for the index's fsync: settle
                        last_checkpoint = time.monotonic()
                        if self._removed.retire():
                            self._subscribe()
            self._checkpoint()
            clean = True
        finally:
            self.running, self._state = False, "stopped"
            self._assignment.failed = not clean  # after a failure nothing more is committed
            try:
                self._member.consumer.close()  # revokes the assignment, which checkpoints once more if clean
            finally:
                self._assignment.close_kept()
                self._checkpoints.close()
                self._dispatcher.close()
                self._drains.close()
                self._ahead_reader.close()
                if self._roll_reader is not None:
                    self._roll_reader.close()
                self._reader.close()
                if self._state_topic is not None:
                    self._state_topic.close()
                self._writer.close(clean)

    @property
    def not_ready_reasons(self) -> list[str]:
        """Why /healthz is 503: read at request time, so a loop stuck on a broker shows as well."""
        reasons = [self._state] if self._state else []
        if self.running and not self.assigned.is_set():
            reasons.append("joining the consumer group")  # the group has not answered yet: nothing is served
        reasons += [r for r in (self._connectivity.reason, self._connectivity.unacknowledged) if r is not None]
        stuck = time.monotonic() - self._turned
        if self.running and stuck > STUCK_S:
            reasons.append(f"Kafka unreachable: no answer for {stuck:.0f} s (the loop is waiting on it)")
        return reasons

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        self._checkpoints.on_commit(error, partitions)

    def _renew_member(self, why: str) -> None:
        """At least once: the member's consumer made again and the engine's state kept. What the old
        consumer still held to commit goes with it: sent after the session lapsed, it is fenced, and
        the fence is fatal (inbound/member.py)."""
        logger.warning("making the group's consumer again; partitions kept until the group gives them back why=%s", why)
        self._assignment.set_aside(self._member.consumer)
        self._member.renew()
        self._rejoin.restart()
        self._checkpoints.member_renewed()
        self._subscribed = frozenset()
        self._subscribe()

    def _current_routes(self) -> dict[str, Routes]:
        return self._routes

    def _hold_released(self, state: PartitionState) -> None:
        self._commands.decide_released(state, self._routes.get(state.topic))

    def _apply(self, policies: PolicySet) -> None:
        """Serve a new policy generation: create topics; a removed topic's pending records go to its
        dead-letter topic (drain.py); a topic back in the policies is served again from its commit."""
        routes = {name: Routes.of(route) for name, route in policies.topics.items()}
        removed = {topic: self._routes[topic].route for topic in set(self._routes) - set(routes)}
        back = [topic for topic in self._removed.topics if topic in routes]
        if removed or back:
            self._checkpoint()  # each drain starts from a commit that holds everything done so far
        self._removed.remove(removed)
        first = self._generation == -1
        self._routes, self._generation = routes, policies.generation
        self.metrics.policy_generation.set(policies.generation)
        self.metrics.export_topics(list(routes))
        self._controls.update(policies)
        self._admin.ensure(policies, self._controls.with_side_topics())
        if first:
            commits = self._admin.group_offsets(self._group_id)
            # Control topics no policy names that still hold pending nacks exist already (ensure
            # counted them): only their dead-letter and outcomes topics may still be missing.
            if self._controls.add(retired(commits, self._admin.partitions, self._controls.read)):
                self._admin.ensure(policies, self._controls.with_side_topics())
            self._removed.find_removed_while_down(commits, [*policies.topics, *self._controls.read], policies)
        for topic in back:
            self._removed.serve_again(topic)
        counts = self._admin.partitions
        for topic, removed_topic in self._removed.topics.items():
            if removed_topic.dead_letter_topic not in counts:
                wanted = {removed_topic.dead_letter_topic: counts.get(topic, 1)}
                self._admin.create(wanted)
                counts.update(wanted)
        outbound = {
            target: (name, counts.get(target, 0))
            for name, route in policies.topics.items()
            for target in [route.dead_letter_topic, *(s.outbound for s in route.subscriptions)]
        }
        for name, removed_topic in self._removed.topics.items():
            outbound[removed_topic.dead_letter_topic] = (name, counts.get(removed_topic.dead_letter_topic, 0))
        inbound = {name: counts.get(name, 0) for name in [*policies.topics, *self._removed.topics]}
        self._writer.partition_map(inbound, outbound)
        self._admin.refresh_retention(list(routes), force=True)
        self._subscribe()
        if removed:
            self._removed.adopt()  # from the commit just made

    def _subscribe(self) -> None:
        """The policies' topics, the control topics, and the removed topics still draining."""
        topics = frozenset([*self._routes, *self._controls.read, *self._removed.topics])
        if topics != self._subscribed:
            first, ordered = not self._subscribed, sorted(topics)
            self._subscribe_to(ordered)
            logger.info("subscribed topics=%s generation=%d", ",".join(ordered), self._generation)
            self._subscribed = topics
            self._coverage.subscribed(ordered, first)  # a static member's return may get an old assignment

    def _subscribe_to(self, topics: list[str]) -> None:
        a = self._assignment
        self._member.consumer.subscribe(topics, on_assign=a.on_assign, on_revoke=a.on_revoke, on_lost=a.on_lost)

    def _restore(self, state: PartitionState, committed: int, metadata: CommitMetadata) -> int | None:
        """The index from the state topic; the roll then brings the payloads its buckets point at.

        A removed topic's partition needs no index: it is drained from its commit (drain.py), and
        its inbound consumer starts at the commit, not at the earliest pending record."""
        if state.topic in self._removed:
            return committed
        if self._state_topic is None:
            return None
        tail = self._state_topic.restore(state, committed, metadata)
        if tail is not None and self._roll is not None and not state.control:
            self._roll.adopt((state.topic, state.partition), min(tail, committed))
        return tail

    def _fence_earlier(self, transactional_id: str) -> bool:
        """A partition last committed by another producer of this identity: a zombie (the same
        --instance-id on another host, or an earlier run whose state dir is gone). Fence it once;
        True when that happened now."""
        ids = self._ids
        if ids is None or transactional_id == self._writer.transactional_id or transactional_id in self._fenced:
            return False
        fenced = ids.owns(transactional_id)
        if fenced:
            self._writer.fence(transactional_id)  # raises when it could not: tried again next time
        self._fenced.add(transactional_id)
        return fenced

    def _on_handoff(self, event: str, moved: int, owned: int) -> None:
        self.metrics.handoffs.labels(event).inc(moved)
        self.metrics.owned_partitions.set(owned)

    def _forget_dispatch(self, key: tuple[str, int]) -> None:
        """A partition that starts draining: what the dispatcher and the roll held of it goes."""
        self._dispatcher.forget(key)
        if self._roll is not None:
            self._roll.forget(key)

    def _forget(self, state: PartitionState) -> None:
        key = (state.topic, state.partition)
        self._idle.forget(key)
        self._drains.forget(key)
        self._forget_dispatch(key)
        self._recent.forget(key)
        self._redelivery.forget(key)
        if state.control:
            self._nacks.forget_partition(key)
        if self._state_topic is not None:
            self._state_topic.forget(state)

    def _delivering(self) -> list[PartitionState]:
        """Partitions that may deliver now: not those still replaying in exactly-once mode, nor control
        partitions replaying in any mode (a nack read again may be superseded or cancelled further on);
        in any mode, not those whose earlier owner's cancels may still be ahead."""
        states = self._assignment.states.values()
        draining = self._removed
        return [
            s
            for s in states
            if not ((s.exact or s.control) and s.replaying)
            and not s.holding
            and s.drain_from is None
            and s.topic not in draining
        ]

    def _intake(self, records: list[Message]) -> None:
        """A batch in slices, what fell due meanwhile going out between two. A batch holds runs of
        one partition, so a slice's first record tells whether it is commands."""
        start = 0
        while start < len(records):
            if start:
                self._dispatch_due(read_ahead=False, untaken=records[start:])
            first = records[start]
            control = self._controls.is_control(first.topic())
            size = CONTROL_SLICE if control else INTAKE_SLICE
            self._receiver.take(records[start : start + size])
            start += size
            if control:
                self._checkpoints.journal(self._assignment.states.get((first.topic(), first.partition())))
        self._redelivery.release()  # nacks held for one read back of their payloads: before any checkpoint

    def _dispatch_due(self, read_ahead: bool = True, untaken: Sequence[Message] = ()) -> None:
        """`untaken`: between two slices of a batch, the records still to take (holds.py)."""
        self._holds.release(untaken)
        states = self._delivering()
        if not self._redelivery.dispatch_due([s for s in states if s.control]):
            self._stalled_until = time.monotonic() + STALL_WAIT_S
        trackers = {(s.topic, s.partition): s.tracker for s in states if not s.control}
        self._gates.wind(states)
        self._dispatcher.turn(trackers, read_ahead, self._gates.of(states))
        if self._roll is not None and read_ahead:
            self._roll.turn(trackers, self._intake_cursors)
        self._writer.poll()

    def _wait_s(self) -> float:
        """Until the dispatcher's next delivery or read-ahead, or the next nack: how long intake may
        block (at most MAX_WAIT_S), and whether there is time for a full garbage collection."""
        states = self._delivering()
        times = [t for s in states if s.control and (t := s.tracker.next_delivery_time()) is not None]
        trackers = {(s.topic, s.partition): s.tracker for s in states if not s.control}
        wake = self._dispatcher.next_wake_ms(trackers, self._gates.of(states))
        clock = self._gates.wake_ms(states)  # keyed partitions' clock records
        times += [t for t in (wake, clock) if t is not None]
        wait = IDLE_WAIT_S if not times else max((min(times) - self.clock.now_ms()) / 1000, 0.0)
        if (self._roll is not None and self._roll.busy) or self._drains.busy:
            wait = 0.0  # the roll, and the drains of removed topics, take a slice per turn
        # A tracker whose next segment failed to load reports a due entry it cannot pop yet: wait
        # for its retry rather than spin.
        return max(wait, self._stalled_until - time.monotonic())

    def _observe_collection(self, reason: str, seconds: float) -> None:
        self.metrics.gc_pauses.labels(reason).observe(seconds)

    def _intake_cursors(self) -> dict[tuple[str, int], int]:
        """The next offset intake reads, per inbound partition (for the horizon roll)."""
        states = self._assignment.states.values()
        return {
            (s.topic, s.partition): s.next_offset
            for s in states
            if not s.control and s.next_offset and s.drain_from is None
        }

    def _rejudge(self, partition: tuple[str, int], record: Message) -> int | None:
        state = self._assignment.states.get(partition)
        routes = self._routes.get(partition[0])
        return self._admission.rejudge(state, routes, record) if state is not None and routes is not None else None

    def _checkpoint(self, whole: bool = True) -> None:
        """`whole`: committed before this returns; else the commit may wait for the fsync (settle)."""
        states = list(self._assignment.states.values())
        started = time.monotonic()
        if self._writer.transactional and self._connectivity.outages != self._outages_seen:
            # After a broker restart the client's transaction and group state are not to be trusted
            # (librdkafka hung on the group coordinator; the group's generation moved on): abort and
            # start again from the last commit, with a new producer.
            raise BrokerError(
                "the brokers were unreachable during this transaction; it is aborted and the engine starts "
                "again from the last commit"
            )
        if self._checkpoints.run(states, whole):
            self.metrics.commits.inc()
        self._connectivity.acknowledging(self._checkpoints.put_off)
        self.metrics.checkpoint_latency.observe(time.monotonic() - started)
        self._dispatcher.checkpointed({(s.topic, s.partition): s.tracker for s in states if not s.control})
        self.degraded = publish_index_gauges(self.metrics, states, list(self._routes))
        if time.monotonic() >= self._due_gauges_at:  # a pass over every bucket's segment table: not every commit
            publish_due_gauges(self.metrics, states, list(self._routes), self.clock.now_ms())
            self._due_gauges_at = time.monotonic() + DUE_GAUGES_EVERY_S
        self._admin.refresh_retention(list(self._routes))
