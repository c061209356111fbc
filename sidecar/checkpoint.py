"""The checkpoint: the one place where progress becomes durable, in a fixed order.

1. Flush the producer. Every outbound, dead-letter and accepted-nack record written so far is
   acknowledged by the broker, or the checkpoint fails and nothing below is done.
2. Checkpoint each tracker at its partition's next offset. The bucket tracker writes its adds
   and pops to RocksDB in one batch; the in-memory tracker has nothing to write.
3. Commit, for each partition whose position or metadata changed, the next offset to read with
   the metadata (earliest pending offset, delivered watermark, intake rules). A partition whose
   tracker could not make itself durable up to that offset is not committed this time.

2b. With a state topic (state/topic.py), write each partition's new bucket snapshots and its
   manifest there. They are not waited for: a manifest that trails the commit is still right,
   only more of the log is read again at a handoff. In exactly-once mode they are part of the
   transaction that step 3 commits.

2c. A partition whose intake-rule history does not fit in Kafka's commit metadata has the whole
   history written to the state topic, and acknowledged (or in the transaction) before the commit
   whose metadata names it (`rules_ref`). Without a state topic the oldest rules are dropped, with
   an error in the log.

At least once: a crash between 2 and 3 leaves local state one checkpoint ahead of Kafka; the
restart uses it (PartitionState.start), since everything it covers was acknowledged in step 1.
Deliveries alone change the watermark, so a checkpoint commits after deliveries even when nothing
new was read.

Exactly once: step 3 is the commit of the transaction that holds every record written since the
last checkpoint, with the offsets and metadata sent into it (KIP-447). The records and the commit
become visible together or not at all, so a crash between 2 and 3 aborts the records, and the
local state written in 2 is ahead of the truth: the restart does not use it (PartitionState.start
requires local state to match the commit exactly). Every partition is committed at its next
offset, a degraded index included: the records it delivered are in this transaction, and its
local state is simply rebuilt from the commit after a crash.
"""

import logging
from collections.abc import Iterable

from confluent_kafka import Consumer, TopicPartition

from sidecar.errors import BrokerError, SidecarError
from sidecar.outbound.writer import Writer
from sidecar.partitions.state import PartitionState
from sidecar.state.topic import StateTopic

logger = logging.getLogger(__name__)


def checkpoint(
    writer: Writer, states: Iterable[PartitionState], consumer: Consumer, state_topic: StateTopic | None = None
) -> int:
    """Run one checkpoint; returns the number of partitions committed."""
    writer.flush()
    exact = writer.transactional
    points: list[tuple[PartitionState, tuple[int, str]]] = []
    claims: list[tuple[PartitionState, tuple[int, str]]] = []
    for state in states:
        if state.claiming:
            # Just assigned, not set up yet: only its last commit again, naming this producer.
            claim = state.claim_point(writer.transactional_id) if writer.transactional_id is not None else None
            if claim is not None:
                claims.append((state, claim))
            continue
        if state.next_offset is not None and state.rebuild is None:
            # A draining partition's index was cleared and stays so: a local index "complete and
            # empty" would hide from a restart the records its commit still says are pending.
            if state.drain_from is None:
                state.tracker.checkpoint(state.next_offset, state.runs_text())
            if state_topic is not None:
                state_topic.publish(state)
        point = state.commit_point(state.tracker.earliest_pending_offset(), exact, writer.transactional_id)
        if point is not None:
            points.append((state, point))
    if _rule_histories(points, state_topic) and not exact:
        writer.flush()  # at least once: a history is acknowledged before a commit names it
    if not points and not exact:
        return 0
    points += claims
    offsets = [TopicPartition(s.topic, s.partition, offset, metadata=meta) for s, (offset, meta) in points]
    try:
        if exact:
            writer.commit(offsets, consumer.consumer_group_metadata())
        else:
            consumer.commit(offsets=offsets, asynchronous=False)
    except SidecarError:
        raise
    except Exception as e:
        raise BrokerError(f"committing inbound offsets failed: {e}; a restart resumes at the last commit") from e
    for state, point in points:
        state.committed = point
    return len(points)


def _rule_histories(points: list[tuple[PartitionState, tuple[int, str]]], state_topic: StateTopic | None) -> bool:
    """Write the rule histories the commit metadata cannot hold; True when one was written."""
    written = False
    for state, _ in points:
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
