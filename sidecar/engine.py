"""The sidecar's loop: inbound -> policy -> tracker -> dispatch -> outbound, on one thread.

One thread keeps the commit rule simple to state and to check: an inbound offset is committed
only when every record before it is delivered, dead-lettered, or durably recorded: in the bucket
tracker's storage, or (in-memory tracker) by the inbound log itself together with the earliest
pending offset that the commit carries. The order of a checkpoint is fixed:

1. flush the producer, so every outbound and dead-letter record written so far is acknowledged;
2. checkpoint each tracker, so its adds and pops are durable (a no-op for the in-memory tracker);
3. commit inbound offsets: the next offset to read, with the earliest offset still pending in the
   commit metadata. A restart whose index did not survive (in-memory tracker, lost state dir)
   rebuilds it by reading the log again from there; a durable index resumes at its own cursor.
"""

import json
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from sidecar.clock import Clock, SystemClock
from sidecar.control.commands import (
    UNKNOWN_MESSAGE,
    UNKNOWN_SUBSCRIPTION,
    NackCommand,
    check_max_delay,
    parse_command,
)
from sidecar.control.nacks import LatestNacks
from sidecar.dispatch.dispatcher import Dispatcher
from sidecar.dispatch.reader import LogReader, TopicPartitionKey
from sidecar.errors import BrokerError, RejectedRecord, SidecarError
from sidecar.kafka_io import consume_batch, consumer_config
from sidecar.metrics import Metrics
from sidecar.outbound.records import dead_letter_headers, outbound_headers
from sidecar.policy import PolicySet, TopicRoute, decide
from sidecar.tracker import DelayedDeliveryTracker
from sidecar.tracker.bucket import BucketTracker

logger = logging.getLogger(__name__)

TrackerFactory = Callable[[str, int], DelayedDeliveryTracker]
NackJobs = dict[TopicPartitionKey, dict[int, list[tuple[NackCommand, Message, int]]]]
"""Redeliveries to make, by inbound partition and offset: (command, its control record, deliver-at)."""

# Longest the loop blocks waiting for records: bounds how late a stop request or a policy change
# is noticed. Due deliveries wake the loop earlier by shortening the wait.
MAX_WAIT_S = 0.1
# Most due entries dispatched per loop turn, so intake keeps flowing while a burst drains.
MAX_NACK_DISPATCH = 50_000
# How often topic retention.ms is re-read for EXCEEDS_RETENTION.
RETENTION_REFRESH_S = 60.0
FLUSH_TIMEOUT_S = 30.0
REBUILD_REPORT_S = 2.0
STALL_WAIT_S = 0.05
COMMIT_METADATA_VERSION = 1


@dataclass
class PartitionState:
    tracker: DelayedDeliveryTracker
    next_offset: int | None = None
    committed: int | None = None
    control: bool = False
    """A control-topic partition: its tracker indexes nack commands by their control offset."""
    rebuild: "Rebuild | None" = None
    """Set while the index of this partition is rebuilt from the log (no usable durable index)."""


@dataclass
class Rebuild:
    """Re-reading [start, until) of an inbound partition to rebuild an index that was not kept.

    Records below `until` were all handled before: those without a delay, rejected ones and those
    sent to ordered subscriptions are skipped; delayed ones are indexed again, and the ones already
    due are delivered again (at least once: the sidecar cannot know whether they went out).
    """

    start: int
    until: int
    started: float = field(default_factory=time.monotonic)
    reported: float = field(default_factory=time.monotonic)
    indexed: int = 0
    redelivered: int = 0


@dataclass
class _Routes:
    """Outbound topics of one inbound topic, split by whether the subscription honours delays."""

    route: TopicRoute
    delayed: list[tuple[str, str]] = field(default_factory=list)
    ordered: list[tuple[str, str]] = field(default_factory=list)
    plain: bool = False
    """A record without headers is delivered at once: delays are on and no fixed delay applies."""

    @classmethod
    def of(cls, route: TopicRoute) -> "_Routes":
        routes = cls(route, plain=route.delay.is_enabled and route.delay.fixed_ms == 0)
        for sub in route.subscriptions:
            (routes.ordered if sub.ordered else routes.delayed).append((sub.name, sub.outbound))
        return routes


class Sidecar:
    def __init__(
        self,
        client_config: dict[str, Any],
        policies: Callable[[], PolicySet],
        tracker_factory: TrackerFactory,
        group_id: str = "delay-sidecar",
        instance_id: str | None = None,
        session_timeout_ms: int = 15_000,
        metrics: Metrics | None = None,
        clock: Clock | None = None,
        commit_interval_ms: int = 1000,
        batch_size: int = 10_000,
        new_topic_partitions: int = 3,
        control_topic: str = "delay-sidecar.control",
        read_ahead_ms: int = 10_000,
    ) -> None:
        self._policies = policies
        self._tracker_factory = tracker_factory
        self.metrics = metrics or Metrics()
        self.clock = clock or SystemClock()
        self._commit_interval_s = commit_interval_ms / 1000
        self._batch_size = batch_size
        self._new_topic_partitions = new_topic_partitions
        self._control_topic = control_topic
        self._control_dead_letter = f"{control_topic}.dlt"
        self._nacks = LatestNacks()
        self._high_watermarks: dict[TopicPartitionKey, int] = {}
        self._stalled_until = 0.0
        self._stop = threading.Event()
        self._librdkafka_logger = logging.getLogger("librdkafka")
        group: dict[str, Any] = {
            "group.id": group_id,
            "session.timeout.ms": session_timeout_ms,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
        }
        if instance_id:
            group["group.instance.id"] = instance_id
        self._consumer = Consumer(
            consumer_config(client_config, **group),
            logger=self._librdkafka_logger,
        )
        self._producer = Producer(
            {
                **client_config,
                "enable.idempotence": True,
                "linger.ms": 5,
                "compression.type": "lz4",
                "partitioner": "murmur2_random",  # the Java client's partitioner: same key, same partition
                "queue.buffering.max.messages": 1_000_000,
                "delivery.report.only.error": True,
                "on_delivery": self._on_delivery,
            },
            logger=self._librdkafka_logger,
        )
        self._admin = AdminClient(client_config)
        self._ahead_reader = LogReader(client_config, self._stop)
        self._reader = LogReader(client_config, self._stop)
        self._dispatcher = Dispatcher(
            self._ahead_reader, self._reader, self._deliver_delayed, self.clock, read_ahead_ms
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._partitions: dict[TopicPartitionKey, PartitionState] = {}
        self._subscribed: frozenset[str] = frozenset()
        self._routes: dict[str, _Routes] = {}
        self._routes_generation = -1
        self._retention_ms: dict[str, int | None] = {}
        self._retention_read_at = 0.0
        self._delivery_errors: list[str] = []
        self._failed = False
        self.degraded: list[str] = []
        """Partitions whose durable index is failing and running from memory (for /healthz)."""
        self.assigned = threading.Event()
        """Set once the group gave this member partitions: it is serving."""
        self.running = False
        self.not_ready_reasons: list[str] = ["starting"]

    # ----------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until stop() is called; raises SidecarError when the broker fails for good."""
        clean = False
        try:
            self._apply_policies(self._policies())
            self.running = True
            self.not_ready_reasons = []
            last_checkpoint = time.monotonic()
            while not self._stop.is_set():
                policies = self._policies()  # one generation judges this whole batch
                if policies.generation != self._routes_generation:
                    self._apply_policies(policies)
                self._dispatch_due()  # due first: after a restart, what fell due while down goes out first
                records = consume_batch(self._consumer, self._batch_size, self._wait_s())
                if records:
                    self._intake(records)
                if time.monotonic() - last_checkpoint >= self._commit_interval_s:
                    self._checkpoint()
                    last_checkpoint = time.monotonic()
            self._checkpoint()
            clean = True
        finally:
            self.running = False
            self.not_ready_reasons = ["stopped"]
            self._close(clean)

    def _close(self, clean: bool) -> None:
        try:
            if clean:
                self._consumer.close()  # revokes the assignment, which checkpoints once more
            else:
                # After a failure nothing more is committed: a restart resumes at the last checkpoint.
                self._failed = True
                self._consumer.close()
        finally:
            self._dispatcher.close()
            self._reader.close()
            self._reader.close()
            self._producer.flush(FLUSH_TIMEOUT_S)

    # ----------------------------------------------------------------- policies and topics

    def _apply_policies(self, policies: PolicySet) -> None:
        self._routes = {name: _Routes.of(route) for name, route in policies.topics.items()}
        self._routes_generation = policies.generation
        self.metrics.policy_generation.set(policies.generation)
        topics = frozenset([*policies.topics, self._control_topic])
        self._ensure_topics(policies)
        self._refresh_retention(force=True)
        if topics != self._subscribed:
            if topics:
                self._consumer.subscribe(
                    sorted(topics), on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
                )
            else:
                self._consumer.unsubscribe()
            logger.info("subscribed topics=%s generation=%d", ",".join(sorted(topics)) or "-", policies.generation)
            self._subscribed = topics

    def _ensure_topics(self, policies: PolicySet) -> None:
        """Create missing outbound and dead-letter topics, with as many partitions as their inbound topic."""
        metadata = self._admin.list_topics(timeout=10)
        existing = {name: len(t.partitions) for name, t in metadata.topics.items() if t.error is None}
        wanted: dict[str, int] = {}
        for name in (self._control_topic, self._control_dead_letter):
            if name not in existing:
                wanted[name] = self._new_topic_partitions
        for name, route in policies.topics.items():
            partitions = existing.get(name, self._new_topic_partitions)
            if name not in existing:
                wanted[name] = partitions
            for target in [route.dead_letter_topic, *(s.outbound for s in route.subscriptions)]:
                if target not in existing:
                    wanted.setdefault(target, partitions)
        if not wanted:
            return
        futures = self._admin.create_topics([NewTopic(t, n) for t, n in wanted.items()], operation_timeout=10)
        for topic, future in futures.items():
            try:
                future.result()
                logger.info("topic created topic=%s partitions=%d", topic, wanted[topic])
            except Exception as e:
                if "TOPIC_ALREADY_EXISTS" not in str(e):
                    raise BrokerError(
                        f"cannot create topic {topic}: {e}; create it yourself or grant CREATE on the cluster"
                    ) from e

    def _refresh_retention(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._retention_read_at < RETENTION_REFRESH_S:
            return
        self._retention_read_at = time.monotonic()
        resources = [ConfigResource("topic", t) for t in self._routes]
        if not resources:
            return
        for resource, future in self._admin.describe_configs(resources, request_timeout=10).items():
            try:
                entry = future.result().get("retention.ms")
                value = int(entry.value) if entry is not None and entry.value is not None else -1
                self._retention_ms[resource.name] = value if value >= 0 else None
            except Exception as e:
                logger.warning("retention unknown topic=%s error=%s", resource.name, e)

    # ----------------------------------------------------------------- rebalancing

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Open each partition's index and choose where reading starts.

        A durable index resumes at its cursor, so indexed data is never read again. Without one
        (in-memory tracker, lost state dir), reading starts at the earliest undelivered offset kept
        in the commit metadata and the index is rebuilt up to the committed offset.
        """
        starts = []
        for tp in consumer.committed(partitions, timeout=30):
            key = (tp.topic, tp.partition)
            control = tp.topic == self._control_topic
            state = self._partitions.get(key)
            if state is None:
                state = PartitionState(self._tracker_factory(tp.topic, tp.partition), control=control)
                self._partitions[key] = state
            committed = tp.offset if tp.offset >= 0 else None
            state.committed = committed
            start = committed if committed is not None else tp.offset
            cursor = state.tracker.index_cursor()
            earliest = commit_metadata(tp.metadata).get("earliest")
            if cursor is not None and (committed is None or cursor >= committed):
                start = cursor
            elif not control and committed is not None and earliest is not None and earliest < committed:
                start = earliest
                state.rebuild = Rebuild(earliest, committed)
                logger.info(
                    "index rebuild started partition=%s/%d from=%d until=%d",
                    tp.topic,
                    tp.partition,
                    earliest,
                    committed,
                )
            starts.append(TopicPartition(tp.topic, tp.partition, start))
        consumer.incremental_assign(starts)
        self.assigned.set()
        logger.info("partitions assigned partitions=%s", _names(starts))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if not self._failed:
            self._checkpoint()
        self._drop(partitions)
        logger.info("partitions revoked partitions=%s", _names(partitions))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Another member may own these now: nothing of theirs is committed; their state is dropped."""
        self._drop(partitions)
        logger.warning("partitions lost partitions=%s", _names(partitions))

    def _drop(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            state = self._partitions.pop((tp.topic, tp.partition), None)
            self._dispatcher.forget((tp.topic, tp.partition))
            if state is not None:
                state.tracker.close()
                if state.control:
                    self._nacks.forget_partition(tp.partition)

    # ----------------------------------------------------------------- intake

    def _wait_s(self) -> float:
        """How long intake may block: until the dispatcher's next delivery or read-ahead, or the next nack."""
        inbound = {k: s.tracker for k, s in self._partitions.items() if not s.control}
        times = [
            t for s in self._partitions.values() if s.control and (t := s.tracker.next_delivery_time()) is not None
        ]
        wake = self._dispatcher.next_wake_ms(inbound)
        if wake is not None:
            times.append(wake)
        wait = MAX_WAIT_S if not times else min(max((min(times) - self.clock.now_ms()) / 1000, 0.0), MAX_WAIT_S)
        # A tracker whose next segment failed to load reports a due entry it cannot pop yet: wait
        # for its retry rather than spin.
        return max(wait, self._stalled_until - time.monotonic())

    def _intake(self, records: list[Message]) -> None:
        """Judge each record once and send it on, index it, or dead-letter it.

        This is the hot path of pass-through traffic: counts are kept per batch, and a record
        with no headers on a topic without a fixed delay skips the policy evaluation.
        """
        now = self.clock.now_ms()
        produce = self._producer.produce
        counts_in: Counter[str] = Counter()
        counts_delayed: Counter[str] = Counter()
        sent_delayed_subs: Counter[str] = Counter()
        sent_ordered_subs: Counter[str] = Counter()
        nacks_due_now: list[tuple[NackCommand, Message, int]] = []
        for record in records:
            error = record.error()
            if error is not None:
                self._consumer_error(error)
                continue
            topic, partition, offset = record.topic(), record.partition(), record.offset()
            state = self._partitions.get((topic, partition))
            if state is not None and state.control:
                self._intake_nack(record, state, now, nacks_due_now)
                continue
            routes = self._routes.get(topic)
            if state is None or routes is None:
                continue  # revoked, or the topic left the policies: not ours to commit any more
            counts_in[topic] += 1
            headers = record.headers()
            publish_ms = record.timestamp()[1]
            if publish_ms <= 0:
                publish_ms = now
            if state.rebuild is not None:
                self._rebuild_one(record, state, state.rebuild, routes, publish_ms, now)
                state.next_offset = offset + 1
                continue
            if headers is None and routes.plain:
                deliver_at = None
            else:
                route = routes.route
                try:
                    decision = decide(route.delay, headers, publish_ms, self._retention_ms.get(topic))
                except RejectedRecord as rejected:
                    self._dead_letter(record, route, rejected)
                    state.next_offset = offset + 1
                    continue
                if decision.overridden:
                    self.metrics.fixed_delay_overridden.labels(topic, route.namespace or "").inc()
                if decision.disabled:
                    self.metrics.delay_disabled.labels(topic, route.namespace or "").inc()
                deliver_at = decision.deliver_at
            key, value = record.key(), record.value()
            delayed = routes.delayed
            if deliver_at is not None and deliver_at > now and delayed and state.tracker.add(offset, deliver_at):
                counts_delayed[topic] += 1
                if self._dispatcher.near(deliver_at, now):
                    self._dispatcher.keep_payload((topic, partition), offset, record)
                delayed = []
            if delayed:
                out_headers = outbound_headers(headers, topic, partition, offset, deliver_at or publish_ms)
                for _, outbound in delayed:
                    try:
                        produce(outbound, value, key, headers=out_headers)
                    except BufferError:
                        self._send(outbound, key, value, out_headers)
                sent_delayed_subs[topic] += 1
            if routes.ordered:
                # Exclusive and failover subscriptions ignore delays: their deliver-at is the publish time.
                out_headers = outbound_headers(headers, topic, partition, offset, publish_ms)
                for _, outbound in routes.ordered:
                    self._send(outbound, key, value, out_headers)
                sent_ordered_subs[topic] += 1
            state.next_offset = offset + 1
        if nacks_due_now:
            self._redeliver_now(nacks_due_now)
        self._producer.poll(0)
        for topic, n in counts_in.items():
            self.metrics.messages_in.labels(topic).inc(n)
        for topic, n in counts_delayed.items():
            self.metrics.messages_delayed.labels(topic).inc(n)
        for topic, n in sent_delayed_subs.items():
            for sub, _ in self._routes[topic].delayed:
                self._labelled(self.metrics.delivered, topic, sub).inc(n)
        for topic, n in sent_ordered_subs.items():
            for sub, _ in self._routes[topic].ordered:
                self._labelled(self.metrics.delivered, topic, sub).inc(n)

    def _rebuild_one(
        self, record: Message, state: PartitionState, rebuild: Rebuild, routes: _Routes, publish_ms: int, now: int
    ) -> None:
        topic, offset = record.topic(), record.offset()
        try:
            deliver_at = decide(routes.route.delay, record.headers(), publish_ms).deliver_at
        except RejectedRecord:
            deliver_at = None  # dead-lettered the first time
        if deliver_at is not None and deliver_at > publish_ms and routes.delayed:
            if deliver_at > now and state.tracker.add(offset, deliver_at):
                rebuild.indexed += 1
            else:  # due, by the batch's clock or by the tracker's
                headers = outbound_headers(record.headers(), topic, record.partition(), offset, deliver_at)
                for sub, outbound in routes.delayed:
                    self._send(outbound, record.key(), record.value(), headers)
                    self.metrics.delivered.labels(topic, sub).inc()
                rebuild.redelivered += 1
        self.metrics.replayed.labels(topic).inc()
        clock = time.monotonic()
        done = offset + 1 >= rebuild.until
        if done or clock - rebuild.reported >= REBUILD_REPORT_S:
            rebuild.reported = clock
            rate = (offset + 1 - rebuild.start) / max(clock - rebuild.started, 1e-3)
            logger.info(
                "index rebuild %s partition=%s/%d offset=%d until=%d indexed=%d redelivered=%d rate=%.0f/s eta=%.0fs",
                "done" if done else "progress",
                topic,
                record.partition(),
                offset,
                rebuild.until,
                rebuild.indexed,
                rebuild.redelivered,
                rate,
                max(rebuild.until - offset - 1, 0) / max(rate, 1e-3),
            )
        if done:
            state.rebuild = None

    def _consumer_error(self, error: KafkaError) -> None:
        if error.fatal():
            raise BrokerError(f"the inbound consumer failed for good: {error}; restart the sidecar")
        logger.warning("consumer error error=%s", error)

    def _dead_letter(self, record: Message, route: TopicRoute, rejected: RejectedRecord) -> None:
        topic, partition, offset = record.topic(), record.partition(), record.offset()
        headers = dead_letter_headers(record.headers(), topic, partition, offset, rejected.code, rejected.message)
        timestamp = record.timestamp()[1]
        self._send(route.dead_letter_topic, record.key(), record.value(), headers, max(timestamp, 0))
        self.metrics.rejected.labels(topic, route.namespace or "", rejected.code).inc()
        logger.debug("record rejected topic=%s partition=%d offset=%d code=%s", topic, partition, offset, rejected.code)

    def _send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        timestamp: int = 0,
    ) -> None:
        while True:
            try:
                self._producer.produce(topic, value, key, headers=headers, timestamp=timestamp)
                return
            except BufferError:
                self._producer.poll(0.05)  # the local queue is full: let the broker catch up

    def _on_delivery(self, error: KafkaError | None, record: Message) -> None:
        if error is not None:
            self._delivery_errors.append(f"{record.topic()}: {error}")

    # ----------------------------------------------------------------- nacks (control topic)

    def _intake_nack(
        self, record: Message, state: PartitionState, now: int, due_now: list[tuple[NackCommand, Message, int]]
    ) -> None:
        offset = record.offset()
        state.next_offset = offset + 1
        subscription = ""
        try:
            command = parse_command(record.value())
            subscription = command.subscription
            routes = self._routes.get(command.topic)
            if routes is None or routes.route.subscription(subscription) is None:
                raise RejectedRecord(
                    UNKNOWN_SUBSCRIPTION,
                    f"topic {command.topic!r} has no subscription {subscription!r} in the policies in force",
                )
            sent_ms = record.timestamp()[1] if record.timestamp()[1] > 0 else now
            check_max_delay(command, routes.route.delay, sent_ms)
            self._check_known_message(command, routes)
        except RejectedRecord as rejected:
            self._reject_command(record, rejected)
            self.metrics.nacks.labels(subscription, rejected.code.lower()).inc()
            return
        # Based on the command's own timestamp, so a replay after a restart keeps the same time.
        deliver_at = command.effective_deliver_at(sent_ms)
        self._nacks.accept(command, (record.partition(), offset))
        if not state.tracker.add(offset, deliver_at):
            due_now.append((command, record, deliver_at))  # already due: redelivered after this batch
        self.metrics.nacks.labels(subscription, "accepted").inc()

    def _check_known_message(self, command: NackCommand, routes: _Routes) -> None:
        """UNKNOWN_MESSAGE: the offset is not in the inbound topic, or not yet delivered to anyone."""
        key = (command.topic, command.partition)
        high = self._high_watermarks.get(key, -1)
        if command.offset >= high:
            try:
                _, high = self._reader.watermarks(command.topic, command.partition)
            except SidecarError:
                high = -1
            self._high_watermarks[key] = high
        if command.offset >= high:
            raise RejectedRecord(
                UNKNOWN_MESSAGE,
                f"{command.topic}/{command.partition} has no offset {command.offset} (its end is {max(high, 0)})",
            )
        owner = self._partitions.get(key)
        sub = routes.route.subscription(command.subscription)
        not_yet = owner is not None and (
            (owner.next_offset is not None and command.offset >= owner.next_offset)
            or (sub is not None and not sub.ordered and owner.tracker.contains(command.offset))
        )
        if not_yet:
            raise RejectedRecord(
                UNKNOWN_MESSAGE,
                f"{command.topic}/{command.partition}@{command.offset} was not delivered to "
                f"{command.subscription!r} yet, so it cannot be nacked",
            )

    def _reject_command(self, record: Message, rejected: RejectedRecord) -> None:
        headers = dead_letter_headers(
            record.headers(), record.topic(), record.partition(), record.offset(), rejected.code, rejected.message
        )
        self._send(self._control_dead_letter, record.key(), record.value(), headers, max(record.timestamp()[1], 0))
        logger.info("nack rejected partition=%d offset=%d code=%s", record.partition(), record.offset(), rejected.code)

    def _dispatch_nacks(self, due: dict[TopicPartitionKey, dict[int, int]]) -> None:
        """Read due commands back from the control log, then their messages from the inbound log."""
        jobs: NackJobs = defaultdict(lambda: defaultdict(list))
        wanted_commands = {key: list(offsets) for key, offsets in due.items()}
        for (_, partition), offset, record in self._reader.read(wanted_commands):
            if record is None:
                logger.error(
                    "due nack command missing from the control log partition=%d offset=%d; raise the "
                    "control topic's retention.ms above the longest nack delay",
                    partition,
                    offset,
                )
                continue
            try:
                command = parse_command(record.value())
            except RejectedRecord:
                continue  # validated when it was accepted; a changed log is not ours to judge twice
            if not self._nacks.claim(command, (partition, offset)):
                self.metrics.nacks.labels(command.subscription, "superseded").inc()
                continue
            deliver_at = due[(self._control_topic, partition)][offset]
            jobs[(command.topic, command.partition)][command.offset].append((command, record, deliver_at))
        self._redeliver_jobs(jobs)

    def _redeliver_now(self, due_now: list[tuple[NackCommand, Message, int]]) -> None:
        """Nacks whose time had already come when they were read: never indexed, redelivered now."""
        jobs: NackJobs = defaultdict(lambda: defaultdict(list))
        for command, record, deliver_at in due_now:
            if self._nacks.claim(command, (record.partition(), record.offset())):
                jobs[(command.topic, command.partition)][command.offset].append((command, record, deliver_at))
            else:
                self.metrics.nacks.labels(command.subscription, "superseded").inc()
        self._redeliver_jobs(jobs)

    def _redeliver_jobs(self, jobs: NackJobs) -> None:
        if not jobs:
            return
        wanted = {key: list(by_offset) for key, by_offset in jobs.items()}
        for key, offset, message in self._reader.read(wanted):
            for command, control_record, deliver_at in jobs[key][offset]:
                self._redeliver(command, control_record, message, deliver_at)

    def _redeliver(self, command: NackCommand, control: Message, message: Message | None, deliver_at: int) -> None:
        routes = self._routes.get(command.topic)
        sub = routes.route.subscription(command.subscription) if routes is not None else None
        try:
            if routes is None or sub is None:
                raise RejectedRecord(UNKNOWN_SUBSCRIPTION, "the subscription left the policies before redelivery")
            if message is None:
                raise RejectedRecord(UNKNOWN_MESSAGE, "the message is no longer in the inbound log (retention)")
            try:
                decide(
                    routes.route.delay,
                    message.headers(),
                    max(message.timestamp()[1], 0),
                    self._retention_ms.get(command.topic),
                )
            except RejectedRecord as rejected:
                raise RejectedRecord(
                    UNKNOWN_MESSAGE,
                    f"the message went to the dead-letter topic ({rejected.code}), never to {command.subscription!r}",
                ) from None
        except RejectedRecord as rejected:
            self._reject_command(control, rejected)
            self.metrics.nacks.labels(command.subscription, rejected.code.lower()).inc()
            return
        headers = outbound_headers(
            message.headers(),
            command.topic,
            command.partition,
            command.offset,
            deliver_at,
            command.redelivery_count + 1,
        )
        self._send(sub.outbound, message.key(), message.value(), headers)
        self.metrics.redeliveries.labels(command.subscription).inc()
        self._labelled(self.metrics.delivered, command.topic, command.subscription).inc()
        self._labelled(self.metrics.lateness, command.topic).observe(max(self.clock.now_ms() - deliver_at, 0) / 1000)

    # ----------------------------------------------------------------- dispatch

    def _dispatch_due(self) -> None:
        inbound: dict[TopicPartitionKey, DelayedDeliveryTracker] = {}
        nacks: dict[TopicPartitionKey, dict[int, int]] = {}
        for key, state in self._partitions.items():
            if not state.control:
                inbound[key] = state.tracker
            elif state.tracker.has_message_available():
                due = state.tracker.pop_due(MAX_NACK_DISPATCH)
                if due:
                    nacks[key] = {d.offset: d.deliver_at for d in due}
                else:
                    self._stalled_until = time.monotonic() + STALL_WAIT_S
        if nacks:
            self._dispatch_nacks(nacks)
        self._dispatcher.turn(inbound)
        self._producer.poll(0)

    def _deliver_delayed(self, partition: TopicPartitionKey, due: list[tuple[int, int, Message | None]]) -> None:
        """Send due records to every subscription that honours delays (called by the dispatcher).

        One call per partition and turn, so counters and the clock are touched once per batch: this
        loop runs for every delayed record.
        """
        topic, number = partition
        routes = self._routes.get(topic)
        produce = self._producer.produce
        lateness = self._labelled(self.metrics.lateness, topic).observe
        now = self.clock.now_ms()
        sent = 0
        for deliver_at, offset, record in due:
            if record is None:
                self.metrics.lost.labels(topic).inc()
                logger.error(
                    "due record missing from the log topic=%s partition=%d offset=%d deliver_at=%d; "
                    "raise the topic's retention.ms above its longest delay",
                    topic,
                    number,
                    offset,
                    deliver_at,
                )
                continue
            if routes is None:
                continue  # the topic left the policies: its subscriptions are gone (README: removal)
            headers = outbound_headers(record.headers(), topic, number, offset, deliver_at)
            key, value = record.key(), record.value()
            for _, outbound in routes.delayed:
                try:
                    produce(outbound, value, key, headers=headers)
                except BufferError:
                    self._send(outbound, key, value, headers)
            lateness((now - deliver_at) / 1000 if now > deliver_at else 0.0)
            sent += 1
        if sent and routes is not None:
            for sub, _ in routes.delayed:
                self._labelled(self.metrics.delivered, topic, sub).inc(sent)

    def _labelled(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), cached: the hot paths count per batch without a lookup and a lock."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # ----------------------------------------------------------------- checkpoint

    def _checkpoint(self) -> None:
        remaining = self._producer.flush(FLUSH_TIMEOUT_S)
        if remaining:
            raise BrokerError(
                f"{remaining} records not acknowledged after {FLUSH_TIMEOUT_S:.0f}s; the broker is "
                "unreachable or overloaded. Nothing past the last checkpoint was committed."
            )
        if self._delivery_errors:
            errors, self._delivery_errors = self._delivery_errors[:5], []
            raise BrokerError(
                f"writes failed ({'; '.join(errors)}); check topic permissions and broker health. "
                "Nothing past the last checkpoint was committed; a restart resumes there."
            )
        offsets = []
        tracked: Counter[str] = Counter()
        for (topic, partition), state in self._partitions.items():
            tracker = state.tracker
            tracked[topic] += len(tracker)
            if state.next_offset is None or state.rebuild is not None:
                continue  # nothing read yet, or a rebuild that a crash would simply start again
            tracker.checkpoint(state.next_offset)
            earliest = tracker.earliest_pending_offset()
            commit = state.next_offset
            if earliest is not None and state.control:
                # The control log is the nacks' write-ahead log: replayed from the earliest pending.
                commit = min(commit, earliest)
            if commit != state.committed:
                metadata = json.dumps(
                    {"v": COMMIT_METADATA_VERSION, "earliest": earliest if earliest is not None else state.next_offset}
                )
                offsets.append(TopicPartition(topic, partition, commit, metadata=metadata))
        for topic in self._routes:
            self.metrics.tracked.labels(topic).set(tracked.get(topic, 0))
        self._publish_tracker_stats()
        if offsets:
            try:
                self._consumer.commit(offsets=offsets, asynchronous=False)
            except Exception as e:
                raise BrokerError(
                    f"committing inbound offsets failed: {e}; a restart resumes at the last commit"
                ) from e
            for tp in offsets:
                self._partitions[(tp.topic, tp.partition)].committed = tp.offset
            self.metrics.commits.inc()
        self._refresh_retention()

    def _publish_tracker_stats(self) -> None:
        buckets: Counter[str] = Counter()
        loaded: Counter[str] = Counter()
        snapshot: Counter[str] = Counter()
        degraded = []
        for (topic, partition), state in self._partitions.items():
            if not isinstance(state.tracker, BucketTracker):
                continue
            current = state.tracker.stats()
            buckets[topic] += current.buckets
            loaded[topic] += current.loaded_indexes
            snapshot[topic] += current.snapshot_bytes
            if current.degraded:
                degraded.append(
                    f"{topic}/{partition}: index storage failing ({','.join(current.degraded_ops)}); "
                    "retrying, entries kept in memory"
                )
        for topic in buckets:
            self.metrics.buckets.labels(topic).set(buckets[topic])
            self.metrics.loaded_indexes.labels(topic).set(loaded[topic])
            self.metrics.snapshot_bytes.labels(topic).set(snapshot[topic])
        self.degraded = degraded


def _names(partitions: list[TopicPartition]) -> str:
    return ",".join(f"{tp.topic}/{tp.partition}" for tp in partitions) or "-"


def commit_metadata(text: str | None) -> dict[str, int]:
    """Decode the metadata the sidecar stores with inbound commits; empty when foreign or absent."""
    try:
        data = json.loads(text or "")
    except ValueError:
        return {}
    if not isinstance(data, dict) or data.get("v") != COMMIT_METADATA_VERSION:
        return {}
    return {k: v for k, v in data.items() if isinstance(v, int)}


__all__ = ["PartitionState", "Sidecar", "SidecarError", "commit_metadata"]
