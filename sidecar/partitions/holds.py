"""Held partitions delivering again: an assignment holds a partition whose commit says an earlier
owner judged cancels or reschedules ahead of it (partitions/assignment.py), so that nothing goes out
before those facts are read again. The hold ends once intake has read to where it ends.

The consumer's position says so even when the log ends in a transaction marker, which no record
reaches. A transaction left open holds the last stable offset back: Kafka aborts it after the
transaction timeout, noida-db never does, so past HOLD_LIMIT_S a partition whose reader has read
all it can delivers again.

Apache Kafka does not need HOLD_LIMIT_S for the sidecar's own transactions: 4.1.1 aborted one
whose producer died 66.8 s after the death (transaction.timeout.ms 60,000; 6.6 s with 5,000),
inside the limit, and the hold then ends as usual. Kept for the fallback broker, noida-db,
whose last stable offset stayed behind such a transaction for as long as it was watched (40 s,
timeout 5,000). On Kafka the limit acts only on another producer's transaction open longer than it.
"""

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from confluent_kafka import KafkaException, Message, TopicPartition

from sidecar.inbound.member import GroupMember
from sidecar.outbound.writer import TRANSACTION_TIMEOUT_MS
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState

logger = logging.getLogger(__name__)

HOLD_LIMIT_S = TRANSACTION_TIMEOUT_MS / 1000 + 15
"""A held partition whose reader has read all it can for this long waits for no transaction: the
broker aborts one open longer than the transaction timeout (Apache Kafka 6.8 s past it here: it looks
every 10 s; noida-db, which does not, never ends it)."""


class Holds:
    def __init__(
        self,
        states: Mapping[TopicPartitionKey, PartitionState],
        position: Callable[[list[TopicPartition]], list[TopicPartition]],
        member: GroupMember,
        released: Callable[[PartitionState], None],
    ) -> None:
        """`position`: the intake consumer's positions (IdleFetch knows the ends its seeks hid);
        `member`: the group's read_committed intake consumer, asked for the last stable offset;
        `released`: called with each partition whose hold is over (inbound/commands.py)."""
        self._states = states
        self._position = position
        self._member = member
        self._released = released

    def release(self, untaken: Sequence[Message] = ()) -> None:
        """Every held partition whose hold is over delivers again.

        `untaken`: records the consumer returned that intake has not taken yet (the rest of a batch,
        between two of its slices). The consumer's position is past them, but a fact among them is
        not read: a partition with one below its hold's end stays held. Released there, it decided
        the requests it had set aside before reading the earlier owner's facts (a cancel answered
        twice in a chaos run at 3f217e7)."""
        held = [s for s in self._states.values() if s.hold_until is not None]
        if not held:
            return
        if untaken:
            keys = {(s.topic, s.partition) for s in held}
            first: dict[TopicPartitionKey, int] = {}
            for record in untaken:
                key = (record.topic(), record.partition())
                if key in keys and key not in first:
                    first[key] = record.offset()
            held = [
                s
                for s in held
                if s.hold_until is None or first.get((s.topic, s.partition), s.hold_until) >= s.hold_until
            ]
            if not held:
                return
        try:
            positions = self._position([TopicPartition(s.topic, s.partition) for s in held])
        except KafkaException:
            return  # asked again next turn
        now = time.monotonic()
        for state, tp in zip(held, positions, strict=True):
            if state.hold_until is None or state.rebuild is not None:
                continue
            if tp.offset >= state.hold_until:
                logger.info("partition delivering again, every earlier fact read partition=%s", state.name)
                state.hold_until = None
            elif now - state.held_since > HOLD_LIMIT_S and tp.offset >= self._stable_end(tp):
                logger.warning(
                    "partition delivering again past a transaction open longer than the transaction timeout "
                    "partition=%s position=%d held_until=%d",
                    state.name,
                    tp.offset,
                    state.hold_until,
                )
                state.hold_until = None
            if state.hold_until is None:
                self._released(state)  # the requests set aside while held are decided before any delivery

    def _stable_end(self, tp: TopicPartition) -> int:
        """The last stable offset, asked of the broker by the read_committed consumer (-1: no answer)."""
        try:
            _, high = self._member.consumer.get_watermark_offsets(tp, timeout=2, cached=False)
        except KafkaException:
            return -1
        return int(high) if high is not None and high >= 0 else -1
