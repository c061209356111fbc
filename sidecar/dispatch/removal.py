"""Topics that left the policies, from their removal until no member holds a pending record of them.

A removed topic stays in the subscription as a *draining* topic. Each of its partitions, once this
member is assigned it, stops intake (paused) and has its pending records dead-lettered from its
last commit by `Drains` (drain.py), a slice per loop turn. A topic back in the policies before its
drain is over is served again from that commit. Every RETIRE_CHECK_S the group's commits are asked
whether any partition of a draining topic still holds a pending record; a topic with none leaves
the subscription. A topic removed while the sidecar was down is found the same way, from the commits
(`removed_while_down`), so it drains whether the sidecar ran at the time or not.
"""

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

from sidecar.broker.admin import committed_offsets
from sidecar.dispatch.drain import Drains, RemovedTopic, holds_pending, removed_while_down
from sidecar.errors import BrokerError
from sidecar.inbound.member import GroupMember
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.metadata import CommitMetadata
from sidecar.partitions.state import PartitionState
from sidecar.policy import PolicySet
from sidecar.policy.model import TopicRoute

logger = logging.getLogger(__name__)

# How often the group's commits are asked whether a removed topic still has pending records anywhere.
RETIRE_CHECK_S = 2.0

Restore = Callable[[PartitionState, int, CommitMetadata], int | None]


class RemovedTopics:
    def __init__(
        self,
        member: GroupMember,
        states: Mapping[TopicPartitionKey, PartitionState],
        drains: Drains,
        partition_counts: Callable[[], Mapping[str, int]],
        forget: Callable[[TopicPartitionKey], None],
        restore: Restore,
    ) -> None:
        """`partition_counts`: each topic's partitions, as the admin client knows them now.
        `forget`: what the dispatch steps hold of a partition that starts draining is dropped.
        `restore`: how a partition served again finds where it starts, as at an assignment."""
        self._member = member
        self._states = states
        self._drains = drains
        self._counts = partition_counts
        self._forget = forget
        self._restore = restore
        self.topics: dict[str, RemovedTopic] = {}
        """Topics out of the policies still subscribed until no member has their pending records."""
        self._retire_at = 0.0

    def __contains__(self, topic: object) -> bool:
        return topic in self.topics

    def __bool__(self) -> bool:
        return bool(self.topics)

    def remove(self, routes: Mapping[str, TopicRoute]) -> None:
        """Topics that just left the policies: drained from here on."""
        for topic, route in routes.items():
            self.topics[topic] = RemovedTopic(topic, route.dead_letter_topic, route.namespace or "")

    def find_removed_while_down(
        self, commits: dict[TopicPartitionKey, tuple[int, str | None]], served: Iterable[str], policies: PolicySet
    ) -> None:
        """At the first policies: topics whose commits hold pending records but that no policy serves."""
        self.topics.update(removed_while_down(commits, set(served), set(self._counts()), policies))

    def adopt(self) -> None:
        """Partitions of removed topics not draining yet (just removed, or just assigned) dead-letter
        their pending records from their commit, a slice per turn (drain.py)."""
        for state in list(self._states.values()):
            if state.drain_from is None and state.topic in self.topics:
                key = (state.topic, state.partition)
                self._forget(key)
                self._drains.start(state, self.topics[state.topic])
                self._member.consumer.pause([TopicPartition(state.topic, state.partition)])

    def serve_again(self, topic: str) -> None:
        """A removed topic is back in the policies before its drain was over: what is still pending
        is delivered after all. Each partition starts again from its last commit, as an assignment does."""
        del self.topics[topic]
        for state in [s for s in self._states.values() if s.topic == topic and s.drain_from is not None]:
            self._drains.forget((topic, state.partition))
            state.drain_from = None
            offset, metadata = state.committed if state.committed is not None else (None, None)
            start = state.start(offset, CommitMetadata.decode(metadata), self._restore)
            try:
                self._member.consumer.seek(
                    TopicPartition(topic, state.partition, OFFSET_BEGINNING if start is None else start)
                )
                self._member.consumer.resume([TopicPartition(topic, state.partition)])
            except KafkaException as e:
                raise BrokerError(
                    f"serving {state.name} again failed ({e.args[0]}); the engine starts again from its commit"
                ) from e
            logger.info("topic back in the policies; serving it again partition=%s from=%s", state.name, start)

    def retire(self) -> bool:
        """Forget the removed topics that no member has pending records of; True when one was."""
        if not self.topics or time.monotonic() < self._retire_at:
            return False
        self._retire_at = time.monotonic() + RETIRE_CHECK_S
        done = [topic for topic in self.topics if not self._drains.draining(topic) and self._drained(topic)]
        for topic in done:
            del self.topics[topic]
            logger.info("removed topic drained in the whole group; unsubscribing topic=%s", topic)
        return bool(done)

    def _drained(self, topic: str) -> bool:
        """No commit of the group for `topic` says a record is pending (or the topic is gone)."""
        partitions = self._counts().get(topic, 0)
        try:
            found = committed_offsets(self._member.consumer, [TopicPartition(topic, p) for p in range(partitions)], 10)
        except KafkaException as e:
            logger.warning("cannot read the commits of a removed topic topic=%s error=%s", topic, e.args[0])
            return False
        return not any(holds_pending(tp.offset, tp.metadata) for tp in found)
