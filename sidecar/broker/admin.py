"""Topics the sidecar needs: created when missing, counted, and their retention read.

Missing inbound, outbound, dead-letter and control topics are created with as many partitions as
their inbound topic, so that one inbound partition maps to one outbound partition.
"""

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from sidecar.clock import Overdue
from sidecar.errors import BrokerError
from sidecar.kafka_io import LIBRDKAFKA
from sidecar.policy import PolicySet

logger = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 10
COORDINATOR_WAIT_S = 60.0
COORDINATOR_MOVING = {
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError._TIMED_OUT,
}
T = TypeVar("T")
# How often topic retention.ms is re-read for EXCEEDS_RETENTION.
RETENTION_REFRESH_S = 60.0
FRESH_CLIENT_AFTER_S = 10.0
"""How long `reachable` goes unanswered before its client is made again (the clients' own
rebootstrap, settings.REBOOTSTRAP_AFTER_MS, did not bring this one back in a CI run)."""


def while_coordinator_moves(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """`call`, asked again while the group's coordinator moves (COORDINATOR_MOVING), for up to
    `timeout_s`: as the Java clients do, rather than failing on what a moment later succeeds. Any
    other error, or the same one past `timeout_s`, is raised as it came (KafkaException)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.1
    while True:
        try:
            return call()
        except KafkaException as e:
            error: KafkaError = e.args[0]
            if error.code() not in COORDINATOR_MOVING or time.monotonic() + pause > deadline:
                raise
            logger.warning(
                "group coordinator moving; asking again what=%s error=%s retry_in_s=%.1f", what, error, pause
            )
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def committed_offsets(consumer: Consumer, partitions: list[TopicPartition], timeout_s: float) -> list[TopicPartition]:
    """The group's commits of `partitions`, asked again while the coordinator moves. An error the
    answer holds for one partition is raised for the whole (KafkaException): that partition's
    offset then says nothing, and read as "nothing committed" it would start where
    auto.offset.reset says, at its first record, or look drained while records are pending."""

    def ask() -> list[TopicPartition]:
        found: list[TopicPartition] = consumer.committed(partitions, timeout=timeout_s)
        for tp in found:
            if tp.error is not None:
                raise KafkaException(tp.error)
        return found

    return while_coordinator_moves(ask, timeout_s, "reading the group's commits")


def replication(explicit: int | None, broker_default: int, brokers: int) -> tuple[int, int]:
    """Replication factor and min.insync.replicas of the topics the sidecar creates.

    The broker's default.replication.factor, raised to min(3, brokers) where it is lower: Kafka's
    own default is 1, and one broker's loss then loses records the sidecar acknowledged. An explicit
    --replication-factor wins. min.insync.replicas is one less (at least 1), so that acks=all writes,
    which every producer of the sidecar makes (idempotence), go on through one broker's loss.
    """
    factor = explicit if explicit is not None else max(broker_default, min(3, brokers))
    return factor, max(1, factor - 1)


class TopicAdmin:
    def __init__(
        self, client_config: dict[str, Any], new_partitions: int, replication_factor: int | None = None
    ) -> None:
        self._admin = AdminClient(client_config, logger=LIBRDKAFKA)
        self._client_config = client_config
        self._unanswered = Overdue(FRESH_CLIENT_AFTER_S)
        self._new_partitions = new_partitions
        self._replication_factor = replication_factor
        self._replication: tuple[int, int] | None = None
        self._warned: set[str] = set()
        """Topics already named by `warn_unreplicated`: each is named once, not at every reload."""
        self.partitions: dict[str, int] = {}
        """Partition count of every topic the policies name, after `ensure`."""
        self.retention_ms: dict[str, int | None] = {}
        self._retention_read_at = 0.0

    def existing(self) -> dict[str, int]:
        """Every topic of the cluster and its partition count."""
        metadata = self._admin.list_topics(timeout=ADMIN_TIMEOUT_S)
        return {name: len(t.partitions) for name, t in metadata.topics.items() if t.error is None}

    def create(
        self,
        wanted: dict[str, int],
        config: dict[str, str] | None = None,
        advice: str = "create it yourself or grant CREATE on the cluster",
    ) -> None:
        """Create topics with these partition counts, replicated (`replication`); one that exists
        already is not an error."""
        factor, min_isr = self.replication()
        settings = {"min.insync.replicas": str(min_isr), **(config or {})}
        futures = self._admin.create_topics(
            [NewTopic(t, n, replication_factor=factor, config=settings) for t, n in wanted.items()],
            operation_timeout=ADMIN_TIMEOUT_S,
        )
        for topic, future in futures.items():
            try:
                future.result()
                logger.info("topic created topic=%s partitions=%d replication_factor=%d", topic, wanted[topic], factor)
            except Exception as e:
                if "TOPIC_ALREADY_EXISTS" not in str(e):
                    if "REPLICATION_FACTOR" in str(e):
                        advice = f"lower --replication-factor (it is {factor}) to the number of brokers or fewer"
                    raise BrokerError(f"cannot create topic {topic}: {e}; {advice}") from e
        self._wait_for_leaders(wanted)

    def replication(self) -> tuple[int, int]:
        """Replication factor and min.insync.replicas of new topics, chosen once from the cluster."""
        if self._replication is None:
            metadata = self._admin.list_topics(timeout=ADMIN_TIMEOUT_S)
            default = self._broker_default_replication(sorted(metadata.brokers))
            self._replication = replication(self._replication_factor, default, len(metadata.brokers))
            logger.info(
                "replication of new topics replication_factor=%d min_insync_replicas=%d brokers=%d broker_default=%d",
                *self._replication,
                len(metadata.brokers),
                default,
            )
        return self._replication

    def _broker_default_replication(self, brokers: list[int]) -> int:
        """The cluster's default.replication.factor; 1 (Kafka's default) when it cannot be read."""
        if not brokers:
            return 1
        resource = ConfigResource("broker", str(brokers[0]))
        try:
            entry = self._admin.describe_configs([resource], request_timeout=ADMIN_TIMEOUT_S)[resource].result()
            value = entry.get("default.replication.factor")
            return int(value.value) if value is not None and value.value is not None else 1
        except Exception as e:  # no DESCRIBE_CONFIGS on the cluster, or a broker that lacks the call
            logger.warning("broker default replication unknown; taking 1 error=%s", e)
            return 1

    def warn_unreplicated(self, topics: Iterable[str]) -> list[str]:
        """Log the topics the sidecar relies on that have one replica on a cluster of several brokers:
        one broker's loss loses their records. Returns them."""
        metadata = self._admin.list_topics(timeout=ADMIN_TIMEOUT_S)
        if len(metadata.brokers) < 2:
            return []
        thin = sorted(
            name
            for name in set(topics)
            if (topic := metadata.topics.get(name)) is not None
            and topic.error is None
            and any(len(p.replicas) < 2 for p in topic.partitions.values())
        )
        self._warned.update(thin)
        if thin:
            logger.warning(
                "topics with a single replica on a cluster of %d brokers: a broker's loss loses their records; "
                "raise their replication factor (kafka-reassign-partitions) topics=%s",
                len(metadata.brokers),
                ",".join(thin),
            )
        return thin

    def _wait_for_leaders(self, wanted: dict[str, int]) -> None:
        """Until the cluster's metadata shows every partition of these topics with a leader.

        Kafka creates a topic in its controller and tells the brokers afterwards: a consumer that
        subscribes in between is told the topic does not exist, and librdkafka asks again only at its
        next metadata refresh, minutes later (a control topic's commands went unanswered for good).
        """
        deadline = time.monotonic() + ADMIN_TIMEOUT_S * 3
        missing = dict(wanted)
        while missing:
            metadata = self._admin.list_topics(timeout=ADMIN_TIMEOUT_S)
            for name in list(missing):
                topic = metadata.topics.get(name)
                if (
                    topic is not None
                    and topic.error is None
                    and len(topic.partitions) >= missing[name]
                    and all(p.leader >= 0 for p in topic.partitions.values())
                ):
                    del missing[name]
            if missing and time.monotonic() > deadline:
                logger.warning("topics created but without leaders yet topics=%s", ",".join(sorted(missing)))
                return
            if missing:
                time.sleep(0.1)

    def ensure(self, policies: PolicySet, own: Iterable[str]) -> None:
        """Create what is missing: `own` are the sidecar's own topics (control topics and theirs).
        Afterwards `partitions` counts every topic the policies name."""
        existing, own = self.existing(), list(own)
        wanted: dict[str, int] = {name: self._new_partitions for name in own if name not in existing}
        for name, route in policies.topics.items():
            partitions = existing.get(name, self._new_partitions)
            if name not in existing:
                wanted[name] = partitions
            for target in [route.dead_letter_topic, *(s.outbound for s in route.subscriptions)]:
                if target not in existing:
                    wanted.setdefault(target, partitions)
        if wanted:
            self.create(wanted)
        self.partitions = {**existing, **wanted}
        relied = [*own, *policies.topics]
        for route in policies.topics.values():
            relied += [route.dead_letter_topic, *(s.outbound for s in route.subscriptions)]
        self.warn_unreplicated(t for t in relied if t in existing and t not in self._warned)

    def group_offsets(self, group_id: str) -> dict[tuple[str, int], tuple[int, str | None]]:
        """Every offset the group has committed, with its metadata, whatever topic it is for: a topic
        that left the policies while the sidecar was down is found only here.

        Asked through a consumer of the group that never joins it, for every partition of the
        cluster, not through the admin API: librdkafka's admin ListConsumerGroupOffsets crashes the
        process (SIGSEGV) when the coordinator answers NOT_COORDINATOR (librdkafka issue 5040),
        which Apache Kafka does while it creates its offsets topic or moves a coordinator."""
        metadata = self._admin.list_topics(timeout=ADMIN_TIMEOUT_S)
        partitions = [
            TopicPartition(name, p)
            for name, topic in metadata.topics.items()
            if topic.error is None and not name.startswith("__")
            for p in topic.partitions
        ]
        if not partitions:
            return {}
        try:
            # A new cluster creates its offsets topic on the first ask, and a coordinator that moves
            # answers NOT_COORDINATOR until the client looks it up again.
            listed = self.last_commits(group_id, partitions, COORDINATOR_WAIT_S)
        except KafkaException as e:
            raise BrokerError(
                f"cannot read the committed offsets of consumer group {group_id}: {e}; check that the "
                "brokers are up and that the sidecar may DESCRIBE its group"
            ) from e
        return {(tp.topic, tp.partition): (tp.offset, tp.metadata) for tp in listed if tp.offset >= 0}

    def last_commits(
        self, group_id: str, partitions: list[TopicPartition], timeout_s: float = COORDINATOR_WAIT_S
    ) -> list[TopicPartition]:
        """The group's last commits of `partitions`, without waiting for a transaction that holds
        newer ones: good for finding what to fence and which topics to look at, not where to start.

        A read_committed consumer asks for stable offsets (librdkafka does at that isolation level,
        KIP-447), and the broker keeps it waiting while a transaction holds offsets of the group. A
        zombie stopped inside its commit holds them until its fence, or until the broker aborts its
        transaction a transaction timeout later (60 s): a successor that read so before fencing it
        failed its engine after 60 s (tests/test_exactly_once.py). Read here without that wait.
        KafkaException as `committed_offsets` raises it."""
        config = {**self._client_config, "group.id": group_id, "enable.auto.commit": False}
        consumer = Consumer({**config, "isolation.level": "read_uncommitted"}, logger=LIBRDKAFKA)
        try:
            return committed_offsets(consumer, partitions, timeout_s)
        finally:
            consumer.close()

    def end_offset(self, topic: str, partition: int) -> int:
        """The partition's high watermark, open transactions included (read_uncommitted): a
        read_committed consumer's own end is the last stable offset, which a transaction still
        committing leaves below its records."""
        tp = TopicPartition(topic, partition)
        try:
            futures = self._admin.list_offsets(
                {tp: OffsetSpec.latest()},
                isolation_level=IsolationLevel.READ_UNCOMMITTED,
                request_timeout=ADMIN_TIMEOUT_S,
            )
            return int(futures[tp].result(timeout=ADMIN_TIMEOUT_S + 5).offset)
        except (KafkaException, TimeoutError) as e:
            raise BrokerError(f"cannot read the end of {topic}/{partition} ({e}); is the broker up?") from e

    def reachable(self) -> bool:
        """True when a broker answers a metadata request within a second. A client that has not
        been answered for FRESH_CLIENT_AFTER_S is replaced by a new one, which starts from the
        bootstrap servers: after a single node's restart, librdkafka 2.16 once kept this client
        away from the node for the two minutes a CI test waited (`Failed while waiting for
        controller`), while the sidecar's consumer was served, and /healthz said unreachable all
        along."""
        try:
            self._admin.list_topics(timeout=1)
        except Exception:
            if self._unanswered.check(True):
                logger.warning("admin client unanswered, made again after_s=%.0f", self._unanswered.held_s)
                self._admin = AdminClient(self._client_config, logger=LIBRDKAFKA)
                self._unanswered.restart()
            return False
        self._unanswered.check(False)
        return True

    def refresh_retention(self, topics: list[str], force: bool = False) -> None:
        """retention.ms of the inbound topics, re-read at most once a minute unless forced."""
        if not force and time.monotonic() - self._retention_read_at < RETENTION_REFRESH_S:
            return
        self._retention_read_at = time.monotonic()
        if not topics:
            return
        resources = [ConfigResource("topic", t) for t in topics]
        for resource, future in self._admin.describe_configs(resources, request_timeout=ADMIN_TIMEOUT_S).items():
            try:
                entry = future.result().get("retention.ms")
                value = int(entry.value) if entry is not None and entry.value is not None else -1
                self.retention_ms[resource.name] = value if value >= 0 else None
            except Exception as e:
                logger.warning("retention unknown topic=%s error=%s", resource.name, e)
