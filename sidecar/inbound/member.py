"""This sidecar's membership of the consumer group: the consumer that reads the inbound and control
topics, and the one way it is made again without the engine starting over.

librdkafka holds a commit that found no coordinator and sends it once one answers, under the member
id the consumer has by then. After the session timed out that id is empty until the member joins
again, and a static member's commit with no member id is refused FENCED_INSTANCE_ID, which
librdkafka makes fatal. The fence is the member's own (the Java consumer fails that commit and goes
on), but the handle is dead. At least once, the engine keeps what it knows and takes a new consumer
(`renew`): its lost partitions come back as it left them, where starting over from the last commit
sent again everything acknowledged since (CI: 3,417 of 6,000 records after a broker restart).
"""

import logging
import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from sidecar.clock import Overdue
from sidecar.kafka_io import LIBRDKAFKA

logger = logging.getLogger(__name__)


class GroupMember:
    """The group's consumer of the moment. The engine's parts reach it through here rather than
    keep a Consumer, so one made again reaches them all (pausing, for inbound/idle_fetch.py, is
    asked of this object directly)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self._settings = settings
        self.consumer = Consumer(settings, logger=LIBRDKAFKA)
        self.renewals = 0

    def renew(self) -> None:
        """Make a new consumer, and close the old one on a thread of its own: librdkafka's close
        waits for the commits the handle still holds, as long as a paused coordinator keeps them
        (55 s in a CI run, the loop held all along). What the old one held goes with it; its
        callbacks are not the engine's any more (`current`). The caller subscribes the new one."""
        old, self.consumer = self.consumer, Consumer(self._settings, logger=LIBRDKAFKA)
        self.renewals += 1
        threading.Thread(target=_close, args=(old,), name="retired-consumer", daemon=True).start()

    def current(self, consumer: Consumer) -> bool:
        """`consumer` is the group's consumer of the moment, not one closing after a renewal."""
        return consumer is self.consumer

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.consumer.pause(partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.consumer.resume(partitions)

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        found: list[TopicPartition] = self.consumer.position(partitions)
        return found

    def seek(self, partition: TopicPartition) -> None:
        self.consumer.seek(partition)

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float | None = None, cached: bool = False
    ) -> tuple[int, int] | None:
        ends: tuple[int, int] | None = self.consumer.get_watermark_offsets(partition, timeout=timeout, cached=cached)
        return ends


REJOIN_MARGIN_S = 30.0
"""How much longer than the session timeout a member may wait for the group to give back its lost
partitions, counted from when the brokers answer: the coordinator holds a rebalance open at most
that long for members that do not come back, so waiting longer is waiting on the client."""


def rejoin_watch(session_timeout_ms: int, clock: Callable[[], float] | None = None) -> Overdue:
    """At least once, how long the group may keep this member's lost partitions from it while the
    brokers answer, before the consumer is made again (`GroupMember.renew`), which joins at once.
    librdkafka rejoins by itself within seconds of their return, but once in a CI run (a broker
    restarted under load, its coordinator answering NOT_COORDINATOR as it shut down) the consumer
    sent no JoinGroup for two minutes: the group, loaded again with the member, expired it after
    the session timeout, and nothing was delivered or committed meanwhile."""
    return Overdue(session_timeout_ms / 1000 + REJOIN_MARGIN_S, clock)


def _close(consumer: Consumer) -> None:
    try:
        consumer.close()
    except (KafkaException, RuntimeError) as e:  # a fatal handle may refuse even its close
        logger.warning("closing the consumer made again failed error=%s", e)
