"""Sending records to the subscriptions they are owed: now at intake, or at their deliver-at.

A delayed record goes to the subscriptions that honoured delays when it was accepted (its intake
rule) and still exist. Both paths take whole lists: the header list of a record is built once and
shared by its subscriptions, outbound partitions are resolved once per list, and counters and the
lateness histogram are touched once per list, not per record.
"""

import logging
from collections import Counter
from collections.abc import Callable, Sequence

from confluent_kafka import KafkaException, Message

from sidecar.clock import Clock
from sidecar.control.cancels import is_marked
from sidecar.metrics import Metrics
from sidecar.outbound.records import DELIVER_AT, ORIGIN, HeaderForm, OutHeaders, outbound_headers
from sidecar.outbound.writer import ANY_PARTITION, Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState
from sidecar.policy.routes import IntakeRule, Routes

logger = logging.getLogger(__name__)

Targets = list[tuple[str, str]]
"""(subscription, outbound topic) pairs a record is owed to."""
Due = tuple[int, int, Message]
"""(deliver-at, offset, record): what is sent, and what the dispatcher hands over."""


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

    def send_many(
        self, partition: TopicPartitionKey, targets: Targets, records: Sequence[Due], sent: Counter[str] | None = None
    ) -> None:
        """(deliver-at, offset, record) of one inbound partition, each to each target, in order."""
        topic, number = partition
        writer = self._writer
        produce = writer.producer.produce
        outs = [(outbound, number if writer.keeps_partition(outbound) else ANY_PARTITION) for _, outbound in targets]
        compact = self._form == "compact"
        prefix = f"{topic}/{number}/".encode()
        for deliver_at, offset, record in records:
            original = record.headers()
            headers: OutHeaders
            if compact:  # outbound_headers' compact form, inlined
                headers = [(k, v if v is not None else b"") for k, v in original] if original else []
                headers.append((ORIGIN, prefix + b"%d" % offset))
                headers.append((DELIVER_AT, b"%d" % deliver_at))
            else:
                headers = outbound_headers(original, topic, number, offset, deliver_at, form="v1")
            key, value = record.key(), record.value()
            for outbound, target in outs:
                try:
                    produce(outbound, value, key, headers=headers, partition=target)
                except (BufferError, KafkaException):  # a full queue waits; a fenced producer raises Fenced
                    writer.send(outbound, key, value, headers, target)
        if sent is not None and records:
            for sub, _ in targets:
                sent[sub] += len(records)

    def delayed(self, partition: TopicPartitionKey, due: list[tuple[int, int, Message | None]]) -> None:
        """Due records of one partition, in deliver-at order (the dispatcher's callback)."""
        topic, number = partition
        state = self._partitions.get(partition)
        routes = self._routes().get(topic)
        if state is None or routes is None:
            logger.error("due records of a partition no longer served dropped partition=%s/%d", topic, number)
            return
        now = self._clock.now_ms()
        sent: Counter[str] = Counter()
        keyed = state.keyed
        if keyed is not None and keyed.replaced:
            due = [d for d in due if not keyed.popped(d[1])]  # replaced: out of the index, to nobody
        if state.overrides:
            due = self._overridden(state, routes, due, sent)
        found: list[Due] = [d for d in due if d[2] is not None]
        if len(found) < len(due):
            for deliver_at, offset, record in due:
                if record is None:
                    self._lost(topic, number, offset, deliver_at)
        single = state.rules.single
        if single is not None:
            self.send_many(partition, routes.targets(single), found, sent)
        else:
            # Consecutive records with one rule go out as one list; a rule change starts the next.
            current = routes.rule(self._retention_ms.get(topic))
            run: list[Due] = []
            run_rule: IntakeRule | None = None
            for item in found:
                rule = state.rules.at(item[1]) or current
                if rule is not run_rule:
                    if run and run_rule is not None:
                        self.send_many(partition, routes.targets(run_rule), run, sent)
                    run, run_rule = [], rule
                run.append(item)
            if run and run_rule is not None:
                self.send_many(partition, routes.targets(run_rule), run, sent)
        metrics = self._metrics
        metrics.observe_lateness(metrics.child(metrics.lateness, topic), now, [d for d, _, _ in found])
        for sub, n in sent.items():
            self._metrics.child(self._metrics.delivered, topic, sub).inc(n)

    def _overridden(
        self, state: PartitionState, routes: Routes, due: list[tuple[int, int, Message | None]], sent: Counter[str]
    ) -> list[tuple[int, int, Message | None]]:
        """Entries that cancels or reschedules touched go out here, to what is left of their
        subscriptions (a copy: with its message's id); the rest are returned for the usual path."""
        overrides, topic = state.overrides, state.topic
        current = routes.rule(self._retention_ms.get(topic))
        rest: list[tuple[int, int, Message | None]] = []
        for item in due:
            deliver_at, offset, record = item
            if offset not in overrides.suppressed and offset not in overrides.copies:
                rest.append(item)
                continue
            owed = (state.rules.at(offset) or current).delayed
            subs, copy = overrides.popped(offset, owed, state.indexed)
            targets = [(sub, routes.outbound[sub]) for sub in subs if sub in routes.outbound]
            if record is None:
                if targets:
                    self._lost(topic, state.partition, offset, deliver_at)
                continue
            if copy is None:
                self.send_many((topic, state.partition), targets, [(deliver_at, offset, record)], sent)
                continue
            original = record.headers()  # the original's: the dispatcher read the copy's payload from it
            if is_marked(original):
                self._lost(topic, state.partition, copy.origin, copy.deliver_at)  # not read: logged, counted
                continue
            headers = outbound_headers(original, topic, state.partition, copy.origin, copy.deliver_at, form=self._form)
            for sub, outbound in targets:
                self._writer.send(
                    outbound, record.key(), record.value(), headers, self._writer.target(outbound, state.partition)
                )
                sent[sub] += 1
        return rest

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
