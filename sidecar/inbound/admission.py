"""A slice of one partition's records, admitted as a batch: judged by the policy step, then sent
now, dead-lettered or indexed.

The fate of each record is decided by `Judge.many` (policy/intake.py), the one place that decides
fates; this step only carries the decisions out. Records sent now go out as lists: to the delayed
subscriptions the ones with no deliver-at, to the ordered subscriptions every admitted record, in
offset order (those ignore delays).
"""

from collections.abc import Sequence

from confluent_kafka import Message

from sidecar.control.cancels import COMMAND_BY
from sidecar.inbound.batch import IntakeBatch
from sidecar.inbound.commands import CommandStep
from sidecar.inbound.indexing import Delayed, Indexer
from sidecar.inbound.keys import KeyedIntake, is_keyed
from sidecar.metrics import Metrics
from sidecar.outbound.delivery import Delivery, Due
from sidecar.outbound.writer import Writer
from sidecar.partitions.state import PartitionState
from sidecar.policy.headers import Headers
from sidecar.policy.intake import Fate, Judge
from sidecar.policy.routes import Routes


class Admission:
    def __init__(
        self,
        retention_ms: dict[str, int | None],
        writer: Writer,
        delivery: Delivery,
        indexer: Indexer,
        metrics: Metrics,
        commands: CommandStep,
    ) -> None:
        self._commands = commands
        self._keys = KeyedIntake(metrics)
        self._retention_ms = retention_ms
        self._writer = writer
        self._delivery = delivery
        self._indexer = indexer
        self._metrics = metrics
        self.judge = Judge()

    def take(self, batch: IntakeBatch, state: PartitionState, routes: Routes, records: Sequence[Message]) -> None:
        headers = [r.headers() for r in records]  # read once: judging needs them too
        # is_marked, inlined: a call per record on the hot path costs more than the test
        marked = [i for i, h in enumerate(headers) if h and h[0][0] == COMMAND_BY]
        if marked and is_keyed(state, batch.rule(state.topic, routes, self._retention_ms.get(state.topic))):
            self._in_log_order(batch, state, routes, records, headers, set(marked))
            return
        if marked:  # requests and facts of cancels and reschedules: rare, decided after the slice's records
            chosen = set(marked)
            plain = [i for i in range(len(records)) if i not in chosen]
            if plain:
                self._admit(batch, state, routes, [records[i] for i in plain], [headers[i] for i in plain])
            self._commands.take(batch, state, routes, [records[i] for i in marked])
            state.next_offset = records[-1].offset() + 1
            return
        self._admit(batch, state, routes, records, headers)

    def _in_log_order(
        self,
        batch: IntakeBatch,
        state: PartitionState,
        routes: Routes,
        records: Sequence[Message],
        headers: list[Headers],
        marked: set[int],
    ) -> None:
        """A keyed partition's slice in runs of messages and of the sidecar's own records, in log
        order: the clock of the keyed step must see every timestamp in offset order."""
        start = 0
        while start < len(records):
            own = start in marked
            end = start + 1
            while end < len(records) and (end in marked) == own:
                end += 1
            if own:
                run = records[start:end]
                self._keys.note(state, run)
                self._commands.take(batch, state, routes, run)
            else:
                self._admit(batch, state, routes, records[start:end], headers[start:end])
            start = end
        state.next_offset = records[-1].offset() + 1

    def _admit(
        self,
        batch: IntakeBatch,
        state: PartitionState,
        routes: Routes,
        records: Sequence[Message],
        headers: list[Headers],
    ) -> None:
        topic = state.topic
        rule = batch.rule(topic, routes, self._retention_ms.get(topic))
        if state.rule is not rule:
            state.rules.note(records[0].offset(), rule)
            state.rule = rule
        now = batch.now
        stamps = [record.timestamp()[1] for record in records]
        published = [s if s > 0 else now for s in stamps]  # a record without a timestamp: read now
        fates = self.judge.many(rule, list(zip(headers, published, strict=True)))
        keyed = is_keyed(state, rule)
        delivered = self._keys.decide(state, rule, records, stamps, fates) if keyed else None
        delayed: list[Delayed] = []
        now_list: list[Due] = []
        ordered: list[Due] | None = [] if routes.ordered else None
        route = routes.route
        for i, (record, at, fate) in enumerate(zip(records, published, fates, strict=True)):
            deliver_at, rejected, overridden, disabled, miscased = fate
            if rejected is not None:
                self._writer.dead_letter(route.dead_letter_topic, record, rejected.code, rejected.message)
                self._metrics.rejected.labels(topic, route.namespace or "", rejected.code).inc()
                continue
            if overridden or disabled or miscased:
                self._count(fate, topic, route.namespace or "")
            offset = record.offset()
            if delivered is not None and not delivered[i]:
                pass  # a tombstone that cancels: not for the delayed subscriptions
            elif deliver_at is None:
                now_list.append((at, offset, record))
            else:
                delayed.append((offset, deliver_at, record))
            if ordered is not None:
                ordered.append((at, offset, record))  # exclusive and failover ignore delays: now, in offset order
        state.next_offset = records[-1].offset() + 1
        sent = batch.sent[topic]
        if now_list:
            self._delivery.send_many((topic, state.partition), routes.delayed, now_list, sent)
        if ordered:
            self._delivery.send_many((topic, state.partition), routes.ordered, ordered, sent)
        if delayed:
            self._indexer.take(batch, state, routes, delayed, gated=keyed)

    def rejudge(self, state: PartitionState, routes: Routes, record: Message) -> int | None:
        """The deliver-at intake gave `record` (for the horizon roll's read of payloads), or None: not
        delayed, or no timestamp."""
        publish_ms = record.timestamp()[1]
        if publish_ms <= 0:
            return None
        rule = state.rules.at(record.offset()) or routes.rule(self._retention_ms.get(state.topic))
        return self.judge(rule, record.headers(), publish_ms).deliver_at

    def _count(self, fate: Fate, topic: str, namespace: str) -> None:
        if fate.overridden:
            self._metrics.fixed_delay_overridden.labels(topic, namespace).inc()
        if fate.disabled:
            self._metrics.delay_disabled.labels(topic, namespace).inc()
        if fate.miscased:
            self._metrics.delay_header_miscased.labels(topic).inc()
