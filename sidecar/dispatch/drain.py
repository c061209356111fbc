"""Dead-lettering the pending records of a topic that left the policies, a slice per loop turn.

A removed topic is not dropped from the consumer group at once: it stays in the subscription as a
*draining* topic (removal.py) until the group's commits say that none of its partitions holds a
pending record. Each partition is drained by the member the group assigns it to, the same way
whether the topic was removed while the sidecar ran or while it was down:

- The drain starts from the partition's last commit: [earliest, committed) holds every pending
  record, and the delivered watermark says which of them went out already. The partition's index
  is cleared, and the inbound consumer pauses the partition: records past the commit are not
  judged, and the committed offset stays where it was, as for any removed topic.
- A consumer of its own reads that range once, in offset order, and judges each record again with
  the intake rule the commit recorded for it, as a rebuild does (partitions/state.py): a delayed
  record above the watermark is pending, and goes to the dead-letter topic with TOPIC_REMOVED.
- Cancels and reschedules count: a record taken back from every subscription is not dead-lettered,
  nor one a reschedule delivered, while one whose reschedule's copy is still pending is, once, even
  when its own deliver-at is past. Their facts (cancels.Fact) follow the records they name in the
  log, so a first pass reads the facts, from `earliest` when the commit says some took records
  back, else from the commit (facts written after it), to the end of the log; then the range is
  read again from `drain_from`.
- Keys count on a keyed topic (`by_key: replace`): a record that a newer one of its key replaced,
  and a tombstone, are no more pending than they were before the removal; only the newest record
  per key is. Which one replaced which is decided by the rule of policy/by_key.py, which needs the
  records after each one, so the first pass reads the whole range too and applies the rule from
  the log's clock the commit recorded; the second dead-letters what it left pending. A commit
  made mid-drain records the clock at `drain_from`, where a drain taken up again starts.
- Progress is the offset reached, `PartitionState.drain_from`. A checkpoint commits it as the
  partition's earliest pending offset, after the producer flush that acknowledged every dead letter
  below it, or in the same transaction (exactly-once). A crash, a stop or a handoff mid-drain
  resumes from there: no pending record is dead-lettered twice or left out.

Offset order rather than delivery order is what makes progress a single offset, and what makes the
pass one sequential read: the pending records of a partition with random delays lie all over its
log, so taking them in deliver-at order a slice at a time would read the log once per slice.

The loop gives the drains DRAIN_SLICE_S per turn, so deliveries of the other topics go on.
"""

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from sidecar.clock import Clock
from sidecar.control.cancels import FACT, Fact, is_marked
from sidecar.errors import BrokerError, ConfigError
from sidecar.inbound.keys import key_inputs, stamp
from sidecar.kafka_io import consume_batch, log_reader
from sidecar.metrics import Metrics
from sidecar.outbound.writer import Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.keyed import KeyedPartition
from sidecar.partitions.metadata import CommitMetadata
from sidecar.partitions.state import PartitionState
from sidecar.policy.intake import Judge
from sidecar.policy.model import EffectiveDelay, PolicySet, Sourced
from sidecar.policy.routes import IntakeRule
from sidecar.tracker.base import pack

logger = logging.getLogger(__name__)

TOPIC_REMOVED = "TOPIC_REMOVED"
# Time a loop turn spends dead-lettering: the other topics' deliveries wait at most about this long.
DRAIN_SLICE_S = 0.03
# Records taken from the drain consumer at a time: the slice's deadline is checked between takes.
TAKE = 500
# A drain that reads nothing (no record, no end of partition) for this long gives up: the engine
# starts again from its last checkpoint, and /healthz says why.
STALL_S = 30.0
_UNKNOWN = "no intake rule recorded for it (committed by an older version): judged with delays on, no limits"
FALLBACK_RULE = IntakeRule(
    EffectiveDelay(Sourced(True, _UNKNOWN), Sourced(0, _UNKNOWN), Sourced(0, _UNKNOWN)), None, ("(removed)",)
)
"""For a commit without intake rules: any record with a delay header counts as delayed."""


@dataclass(frozen=True)
class RemovedTopic:
    """A topic no longer in the policies whose pending records are still to be dead-lettered."""

    name: str
    dead_letter_topic: str
    namespace: str = ""


class TakenBack:
    """A drained partition's cancels and reschedules, from its facts in log order: which records are
    still owed to some subscription."""

    def __init__(self) -> None:
        self._suppressed: set[tuple[int, str]] = set()
        self._carrier: dict[tuple[int, str], tuple[int, int]] = {}
        """(message offset, subscription) -> the copy of its latest reschedule: offset, deliver-at."""

    def add(self, fact: Fact) -> None:
        self._suppressed.update(fact.suppress)
        if fact.copy is not None and fact.deliver_at is not None:
            for sub in fact.subs:
                self._carrier[(fact.origin, sub)] = (fact.copy, fact.deliver_at)

    def owed(self, origin: int, deliver_at: int, subscriptions: tuple[str, ...], through: int) -> bool:
        """Whether the record at `origin` is still pending for one of `subscriptions`: its carrier
        (the record, or its latest reschedule's copy) is past the delivered watermark and was not
        taken back from that subscription."""
        if not subscriptions:  # owed to no delayed subscription: as the index has it
            return pack(deliver_at, origin) > through
        for sub in subscriptions:
            carrier, at = self._carrier.get((origin, sub), (origin, deliver_at))
            if (carrier, sub) not in self._suppressed and pack(at, carrier) > through:
                return True
        return False


@dataclass
class _Job:
    state: PartitionState
    topic: RemovedTopic
    end: int
    """The committed offset: the pending records all lie below it."""
    through: int
    """The committed watermark: records at or below it were delivered."""
    facts_from: int | None = None
    """Where the first pass, for facts, reads from; None once it reached the end of the log."""
    keys: bool = False
    """The range holds records of a keyed rule, or the commit a clock: the first pass applies the
    key rule to it."""
    clock_before: int | None = None
    """The log's clock just before `drain_from` when the drain started (the commit's)."""
    keyed: KeyedPartition | None = None
    """The key rule over the range, from its first record under a keyed rule (as intake starts it):
    its `replaced` are not pending."""
    taken: TakenBack = field(default_factory=TakenBack)
    sent: int = 0
    counted: int = 0
    """Of `sent`, how many the metric has."""
    absent: int = 0
    """Offsets of the range the log no longer has (retention, compaction) or never had as records
    (transaction markers)."""
    started: float = field(default_factory=time.monotonic)


def holds_pending(offset: int, metadata: str | None) -> bool:
    """A commit that says records below it are still pending."""
    earliest = CommitMetadata.decode(metadata).earliest
    return offset >= 0 and earliest is not None and earliest < offset


def removed_while_down(
    commits: Mapping[tuple[str, int], tuple[int, str | None]],
    served: Collection[str],
    existing: Collection[str],
    policies: PolicySet,
) -> dict[str, RemovedTopic]:
    """The topics whose pending records the group's `commits` hold but that are not `served`: removed
    from the policies while the sidecar was down. They drain as on a live removal.

    A topic deleted from the cluster (not in `existing`) has nothing left to dead-letter. The
    policies no longer say which dead-letter topic a removed topic had: it is the default one,
    `<topic>.dlt`, and its namespace is the one a namespace glob still gives it."""
    pending: dict[str, int] = {}
    for (topic, _), (offset, metadata) in commits.items():
        if topic not in served and topic in existing and holds_pending(offset, metadata):
            pending[topic] = pending.get(topic, 0) + 1
    found = {}
    for topic, partitions in sorted(pending.items()):
        try:
            namespace = policies.namespace_of(topic) or ""
        except ConfigError:
            namespace = ""  # matches several namespace globs: it is no longer the policies' to say
        found[topic] = RemovedTopic(topic, f"{topic}.dlt", namespace)
        logger.warning(
            "topic removed while the sidecar was down; its pending records go to the dead-letter topic "
            "topic=%s partitions_pending=%d dead_letter_topic=%s",
            topic,
            partitions,
            found[topic].dead_letter_topic,
        )
    return found


class Drains:
    def __init__(
        self, client_config: dict[str, Any], writer: Writer, metrics: Metrics, clock: Clock, group_id: str
    ) -> None:
        self._client_config = client_config
        self._group = group_id.encode()
        self._writer = writer
        self._metrics = metrics
        self._clock = clock
        self._consumer: Consumer | None = None
        self._jobs: dict[TopicPartitionKey, _Job] = {}
        self._judge = Judge()
        self._progressed = time.monotonic()

    @property
    def busy(self) -> bool:
        """A drain is under way: the loop should not sleep between turns."""
        return bool(self._jobs)

    def draining(self, topic: str) -> bool:
        """This member is still dead-lettering some partition of `topic`."""
        return any(job.topic.name == topic for job in self._jobs.values())

    def start(self, state: PartitionState, topic: RemovedTopic) -> None:
        """Drain `state` from its last commit (see the module docstring); the caller pauses it in the
        inbound consumer. A partition whose commit says nothing is pending is done at once."""
        committed = state.committed
        metadata = CommitMetadata.decode(committed[1]) if committed is not None else CommitMetadata()
        tracker = state.tracker
        tracker.clear()
        tracker.restore_delivered_through(metadata.through)
        # The rules stay those `start` or live intake gave the partition: the commit's history.
        state.rebuild = None
        # The live key state goes with the index; the drain keeps the clock at its progress.
        state.keyed, state.clock_at_start = None, metadata.clock
        if committed is None:
            state.drain_from, state.next_offset = 0, None  # nothing committed: nothing of ours is pending
            return
        end = committed[0]
        earliest = metadata.earliest if metadata.earliest is not None else end
        state.next_offset = end
        state.drain_from = min(earliest, end)
        if earliest >= end:
            return
        if state.rules.at(earliest) is None:
            logger.warning("no intake rules in the commit; judging with delays on partition=%s", state.name)
        key = (state.topic, state.partition)
        keys = metadata.clock is not None or any(rule.keyed for _, rule in state.rules.items())
        # Facts before the commit matter only if it says some took records back that are pending.
        facts_from = earliest if metadata.commands or keys else end
        self._jobs[key] = _Job(state, topic, end, metadata.through, facts_from, keys, metadata.clock)
        self._metrics.rejected.labels(topic.name, topic.namespace, TOPIC_REMOVED)  # exported from 0 on
        self._reader().incremental_assign([TopicPartition(state.topic, state.partition, facts_from)])
        self._progressed = time.monotonic()
        logger.info(
            "dead-lettering the pending records of a removed topic partition=%s from=%d until=%d dead_letter_topic=%s",
            state.name,
            earliest,
            end,
            topic.dead_letter_topic,
        )

    def forget(self, partition: TopicPartitionKey) -> None:
        """The partition was revoked, or its topic is back in the policies: stop where it is (the
        checkpoint before this committed the progress)."""
        job = self._jobs.pop(partition, None)
        if job is not None:
            self._count(job)
            self._unassign(partition)

    def turn(self, slice_s: float = DRAIN_SLICE_S) -> None:
        """Dead-letter for about `slice_s`: what the drain consumer has, and what arrives meanwhile."""
        if not self._jobs:
            return
        consumer = self._reader()
        deadline = time.monotonic() + slice_s
        while self._jobs:
            records = consume_batch(consumer, TAKE, min(max(deadline - time.monotonic(), 0.0), 0.005))
            for record in records:
                self._take(record)
            if not records or time.monotonic() >= deadline:
                break
        for job in self._jobs.values():
            self._count(job)
        if self._jobs and time.monotonic() - self._progressed > STALL_S:
            names = ",".join(job.state.name for job in self._jobs.values())
            raise BrokerError(
                f"reading removed topics' partitions ({names}) to dead-letter their pending records got nothing "
                f"for {STALL_S:.0f} s; check that the brokers are up and those topics readable"
            )

    def _take(self, record: Message) -> None:
        key = (record.topic(), record.partition())
        job = self._jobs.get(key)
        if job is None:
            return  # fetched before the partition was let go
        state = job.state
        assert state.drain_from is not None
        if job.facts_from is not None:
            self._read_fact(job, record)
            return
        error = record.error()
        offset = record.offset()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                logger.warning("removed topic read error partition=%s error=%s", state.name, error)
                return
            self._progressed = time.monotonic()
            if offset >= state.drain_from:  # the log ends here: what is left of the range is not in it
                job.absent += max(job.end - state.drain_from, 0)
                self._finish(key, job)
            return
        self._progressed = time.monotonic()
        if offset < state.drain_from:
            return
        if offset >= job.end:
            job.absent += job.end - state.drain_from
            self._finish(key, job)
            return
        job.absent += offset - state.drain_from
        headers = record.headers()
        rule = state.rules.at(offset) or FALLBACK_RULE
        if job.keys and (state.clock_at_start is not None or rule.keyed):  # the clock at the progress
            state.clock_at_start = max(stamp(record), -1 if state.clock_at_start is None else state.clock_at_start)
        if is_marked(headers):  # a request or a fact: not a message (its facts were read first)
            state.drain_from = offset + 1
            if state.drain_from >= job.end:
                self._finish(key, job)
            return
        publish_ms = record.timestamp()[1]
        fate = self._judge(rule, headers, publish_ms if publish_ms > 0 else self._clock.now_ms())
        deliver_at = fate.deliver_at
        if job.keyed is not None and (offset in job.keyed.replaced or key_inputs(rule, [record], [fate])[1][0]):
            deliver_at = None  # replaced by a newer record of its key, or a tombstone: not pending
        if deliver_at is not None and job.taken.owed(offset, deliver_at, rule.delayed, job.through):
            self._writer.dead_letter(
                job.topic.dead_letter_topic,
                record,
                TOPIC_REMOVED,
                f"the topic left the policies before this record's deliver-at {deliver_at}",
            )
            job.sent += 1
        state.drain_from = offset + 1
        if state.drain_from >= job.end:
            self._finish(key, job)

    def _read_fact(self, job: _Job, record: Message) -> None:
        """The first pass: facts of this group, to the end of the log, and the key rule over the
        range; then back to `drain_from`."""
        error = record.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                logger.warning("removed topic read error partition=%s error=%s", job.state.name, error)
                return
            self._progressed = time.monotonic()
            job.facts_from = None
            state = job.state
            assert state.drain_from is not None
            self._reader().seek(TopicPartition(state.topic, state.partition, state.drain_from))
            return
        self._progressed = time.monotonic()
        headers = record.headers()
        fact = None
        if headers and len(headers) >= 2 and headers[0][1] == self._group and headers[1][0] == FACT:
            fact = Fact.decode(headers[1][1])
            if fact is not None:
                job.taken.add(fact)
        if job.keys and job.state.drain_from is not None and job.state.drain_from <= record.offset() < job.end:
            self._take_key(job, record, headers, fact)

    def _take_key(self, job: _Job, record: Message, headers: Any, fact: Fact | None) -> None:
        """One record of the range through the key rule, as intake and a rebuild take it
        (inbound/keys.py, inbound/commands.py): every record moves the clock, a reschedule's fact
        moves its key's time, and a message may replace its key's pending record."""
        offset = record.offset()
        rule = job.state.rules.at(offset) or FALLBACK_RULE
        keyed = job.keyed
        if keyed is None:
            if not rule.keyed and job.clock_before is None:
                return  # the keyed state starts at the first record of a keyed rule
            keyed = job.keyed = KeyedPartition(job.state.tracker.key_index(), job.clock_before)
        if is_marked(headers):
            keyed.note(offset, stamp(record))
            if fact is not None and fact.key is not None and fact.deliver_at is not None:
                keyed.moved(fact.key, fact.origin, fact.deliver_at)
            return
        publish_ms = record.timestamp()[1]
        fate = self._judge(rule, headers, publish_ms if publish_ms > 0 else self._clock.now_ms())
        keys, tombstones = key_inputs(rule, [record], [fate])
        keyed.take_many([offset], [stamp(record)], keys, tombstones, [fate.deliver_at])

    def _finish(self, key: TopicPartitionKey, job: _Job) -> None:
        job.state.drain_from = job.end
        del self._jobs[key]
        self._count(job)
        self._unassign(key)
        logger.warning(
            "topic removed; pending records dead-lettered partition=%s records=%d dead_letter_topic=%s "
            "absent_offsets=%d seconds=%.1f",
            job.state.name,
            job.sent,
            job.topic.dead_letter_topic,
            job.absent,
            time.monotonic() - job.started,
        )

    def _count(self, job: _Job) -> None:
        if job.sent > job.counted:
            self._metrics.rejected.labels(job.topic.name, job.topic.namespace, TOPIC_REMOVED).inc(
                job.sent - job.counted
            )
            job.counted = job.sent

    def _unassign(self, key: TopicPartitionKey) -> None:
        if self._consumer is not None:
            self._consumer.incremental_unassign([TopicPartition(key[0], key[1])])

    def _reader(self) -> Consumer:
        if self._consumer is None:
            # The range comes from the group's commit; offsets of it deleted by retention are counted.
            # Exactly once, the facts of aborted transactions (a zombie's) are not facts.
            committed = {"isolation.level": "read_committed"} if self._writer.transactional else {}
            self._consumer = log_reader(self._client_config, "delay-sidecar.drain-reader", **committed)
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
