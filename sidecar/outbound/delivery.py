"""Sending a record to the subscriptions it is owed: now at intake, or at its deliver-at.

A delayed record goes to the subscriptions that honoured delays when it was accepted (its intake
rule) and still exist. This loop runs for every delayed record, so counters and the clock are
touched once per batch.
"""

import logging
from collections import Counter
from collections.abc import Callable

from confluent_kafka import KafkaException, Message

from sidecar.clock import Clock
from sidecar.metrics import Metrics
from sidecar.outbound.records import outbound_headers
from sidecar.outbound.writer import Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState
from sidecar.policy.routes import IntakeRule, Routes

logger = logging.getLogger(__name__)


class Delivery:
    def __init__(
        self,
        writer: Writer,
        partitions: dict[TopicPartitionKey, PartitionState],
        routes: Callable[[], dict[str, Routes]],
        retention_ms: dict[str, int | None],
        metrics: Metrics,
        clock: Clock,
    ) -> None:
        self._writer = writer
        self._partitions = partitions
        self._routes = routes
        self._retention_ms = retention_ms
        self._metrics = metrics
        self._clock = clock

    def send(
        self, targets: list[tuple[str, str]], record: Message, deliver_at: int, sent: Counter[str] | None = None
    ) -> None:
        """`record` to each (subscription, outbound) now, with its origin and effective deliver-at."""
        topic, partition = record.topic(), record.partition()
        headers = outbound_headers(record.headers(), topic, partition, record.offset(), deliver_at)
        key, value = record.key(), record.value()
        produce, target = self._writer.producer.produce, self._writer.target
        for sub, outbound in targets:
            try:
                produce(outbound, value, key, headers=headers, partition=target(outbound, partition))
            except (BufferError, KafkaException):  # a full queue waits; a fenced producer raises Fenced
                self._writer.send(outbound, key, value, headers, target(outbound, partition))
            if sent is not None:
                sent[sub] += 1

    def delayed(self, partition: TopicPartitionKey, due: list[tuple[int, int, Message | None]]) -> None:
        """Due records of one partition, in deliver-at order (the dispatcher's callback)."""
        topic, number = partition
        state = self._partitions.get(partition)
        routes = self._routes().get(topic)
        if state is None or routes is None:
            logger.error("due records of a partition no longer served dropped partition=%s/%d", topic, number)
            return
        lateness = self._metrics.child(self._metrics.lateness, topic).observe
        now = self._clock.now_ms()
        single = state.rules.single
        current = routes.rule(self._retention_ms.get(topic))
        targets: dict[int, list[tuple[str, str]]] = {}
        sent: Counter[str] = Counter()
        for deliver_at, offset, record in due:
            if record is None:
                self._metrics.lost.labels(topic).inc()
                logger.error(
                    "due record missing from the log topic=%s partition=%d offset=%d deliver_at=%d; "
                    "raise the topic's retention.ms above its longest delay",
                    topic,
                    number,
                    offset,
                    deliver_at,
                )
                continue
            rule: IntakeRule = single or state.rules.at(offset) or current
            found = targets.get(id(rule))
            if found is None:
                found = targets[id(rule)] = routes.targets(rule)
            self.send(found, record, deliver_at, sent)
            lateness((now - deliver_at) / 1000 if now > deliver_at else 0.0)
        for sub, n in sent.items():
            self._metrics.child(self._metrics.delivered, topic, sub).inc(n)
