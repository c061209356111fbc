"""Sending records to the subscriptions they are owed: now at intake, or at their deliver-at.

A delayed record goes to the subscriptions that honoured delays when it was accepted (its intake
rule) and still exist. Both paths take whole lists: the header list of a record is built once and
shared by its subscriptions, outbound partitions are resolved once per list, and counters and the
lateness histogram are touched once per list, not per record.
"""

import logging
from collections import Counter
from collections.abc import Callable, Iterable

from confluent_kafka import KafkaException, Message

from sidecar.clock import Clock
from sidecar.metrics import Metrics
from sidecar.outbound.records import DELIVER_AT, ORIGIN, HeaderForm, OutHeaders, outbound_headers
from sidecar.outbound.writer import ANY_PARTITION, Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState
from sidecar.policy.routes import IntakeRule, Routes

logger = logging.getLogger(__name__)

Targets = list[tuple[str, str]]
"""(subscription, outbound topic) pairs a record is owed to."""


class Delivery:
    def __init__(
        self,
        writer: Writer,
        partitions: dict[TopicPartitionKey, PartitionState],
        routes: Callable[[], dict[str, Routes]],
        retention_ms: dict[str, int | None],
        metrics: Metrics,
        clock: Clock,
        header_form: HeaderForm = "compact",
    ) -> None:
        self._writer = writer
        self._partitions = partitions
        self._routes = routes
        self._retention_ms = retention_ms
        self._metrics = metrics
        self._clock = clock
        self._form = header_form

    def send(self, targets: Targets, record: Message, deliver_at: int, sent: Counter[str] | None = None) -> None:
        """`record` to each (subscription, outbound) now, with its origin and effective deliver-at."""
        self.send_many(record.topic(), targets, [(record, deliver_at)], sent)

    def send_many(
        self,
        topic: str,
        targets: Targets,
        records: Iterable[tuple[Message, int]],
        sent: Counter[str] | None = None,
    ) -> int:
        """Records of `topic`, each with its deliver-at, to each target in order. Returns how many."""
        writer = self._writer
        produce = writer.producer.produce
        outs = [(outbound, writer.keeps_partition(outbound)) for _, outbound in targets]
        compact = self._form == "compact"
        n = 0
        for record, deliver_at in records:
            partition, offset = record.partition(), record.offset()
            original = record.headers()
            headers: OutHeaders
            if compact:
                headers = [(k, v if v is not None else b"") for k, v in original] if original else []
                headers.append((ORIGIN, f"{topic}/{partition}/{offset}".encode()))
                headers.append((DELIVER_AT, b"%d" % deliver_at))
            else:
                headers = outbound_headers(original, topic, partition, offset, deliver_at, form="v1")
            key, value = record.key(), record.value()
            for outbound, keep in outs:
                target = partition if keep else ANY_PARTITION
                try:
                    produce(outbound, value, key, headers=headers, partition=target)
                except (BufferError, KafkaException):  # a full queue waits; a fenced producer raises Fenced
                    writer.send(outbound, key, value, headers, target)
            n += 1
        if sent is not None and n:
            for sub, _ in targets:
                sent[sub] += n
        return n

    def delayed(self, partition: TopicPartitionKey, due: list[tuple[int, int, Message | None]]) -> None:
        """Due records of one partition, in deliver-at order (the dispatcher's callback)."""
        topic, number = partition
        state = self._partitions.get(partition)
        routes = self._routes().get(topic)
        if state is None or routes is None:
            logger.error("due records of a partition no longer served dropped partition=%s/%d", topic, number)
            return
        now = self._clock.now_ms()
        single = state.rules.single
        current = routes.rule(self._retention_ms.get(topic))
        sent: Counter[str] = Counter()
        late: list[float] = []
        # Consecutive records with one rule go out as one list; a rule change (rare) starts the next.
        run: list[tuple[Message, int]] = []
        run_rule: IntakeRule | None = None
        for deliver_at, offset, record in due:
            if record is None:
                self._lost(topic, number, offset, deliver_at)
                continue
            rule: IntakeRule = single or state.rules.at(offset) or current
            if rule is not run_rule:
                if run and run_rule is not None:
                    self.send_many(topic, routes.targets(run_rule), run, sent)
                run, run_rule = [], rule
            run.append((record, deliver_at))
            late.append((now - deliver_at) / 1000 if now > deliver_at else 0.0)
        if run and run_rule is not None:
            self.send_many(topic, routes.targets(run_rule), run, sent)
        self._metrics.observe_many(self._metrics.child(self._metrics.lateness, topic), late)
        for sub, n in sent.items():
            self._metrics.child(self._metrics.delivered, topic, sub).inc(n)

    def _lost(self, topic: str, partition: int, offset: int, deliver_at: int) -> None:
        self._metrics.lost.labels(topic).inc()
        logger.error(
            "due record missing from the log topic=%s partition=%d offset=%d deliver_at=%d; "
            "raise the topic's retention.ms above its longest delay",
            topic,
            partition,
            offset,
            deliver_at,
        )
