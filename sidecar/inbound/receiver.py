"""Inbound batches: each record judged once (`intake.judge`), then sent on, indexed or dead-lettered.

This is the hot path of pass-through traffic: counts are kept per batch, and a record with no
headers on a topic without a fixed delay skips the policy evaluation. Records below a rebuild's
end were judged before a restart: they are judged again with the rule recorded for them, and only
those still pending are indexed (or sent, when due).
"""

import logging
from collections import Counter, defaultdict
from collections.abc import Callable

from confluent_kafka import KafkaError, Message

from sidecar.clock import Clock
from sidecar.control.acceptance import Acceptance
from sidecar.control.commands import AcceptedNack
from sidecar.control.redelivery import Redelivery
from sidecar.dispatch.dispatcher import Dispatcher
from sidecar.dispatch.payload_cache import CacheBatch, PayloadCache
from sidecar.errors import BrokerError
from sidecar.metrics import Metrics
from sidecar.outbound.delivery import Delivery
from sidecar.outbound.writer import Writer
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState, Rebuild
from sidecar.policy.intake import Fate, Judge, judge
from sidecar.policy.routes import IntakeRule, Routes
from sidecar.tracker.base import pack

logger = logging.getLogger(__name__)

NOW = Fate(None)


class Receiver:
    def __init__(
        self,
        partitions: dict[TopicPartitionKey, PartitionState],
        routes: Callable[[], dict[str, Routes]],
        retention_ms: dict[str, int | None],
        writer: Writer,
        delivery: Delivery,
        dispatcher: Dispatcher,
        acceptance: Acceptance,
        redelivery: Redelivery,
        metrics: Metrics,
        clock: Clock,
        payloads: PayloadCache | None = None,
        runs: bool = False,
    ) -> None:
        """`runs`: form monotone runs at intake (runs already pending are delivered either way)."""
        self._runs = runs
        self._payloads = payloads
        self._partitions = partitions
        self._routes = routes
        self._retention_ms = retention_ms
        self._writer = writer
        self._delivery = delivery
        self._dispatcher = dispatcher
        self._acceptance = acceptance
        self._redelivery = redelivery
        self._metrics = metrics
        self._clock = clock
        self._judge = Judge()

    def take(self, records: list[Message]) -> None:
        now = self._clock.now_ms()
        routes_now = self._routes()
        rules: dict[str, IntakeRule] = {}
        counts_in: Counter[str] = Counter()
        counts_delayed: Counter[str] = Counter()
        sent: defaultdict[str, Counter[str]] = defaultdict(Counter)
        nacks_due: list[tuple[int, int, AcceptedNack]] = []
        offered: dict[TopicPartitionKey, PartitionState] = {}
        # Payloads of records indexed for later, in one write per batch (kept in memory when near due).
        payloads = self._payloads.batch(now) if self._payloads is not None else None
        for record in records:
            error = record.error()
            if error is not None:
                self._consumer_error(error)
                continue
            topic, partition, offset = record.topic(), record.partition(), record.offset()
            state = self._partitions.get((topic, partition))
            if state is None:
                continue  # revoked: not ours to commit any more
            if state.control:
                due: list[tuple[int, AcceptedNack]] = []
                self._acceptance.take(record, state, due)
                nacks_due += [(partition, o, nack) for o, nack in due]
                continue
            routes = routes_now.get(topic)
            if routes is None:
                continue  # the topic left the policies; its pending records were dead-lettered
            counts_in[topic] += 1
            publish_ms = record.timestamp()[1]
            stamped = publish_ms > 0
            if not stamped:
                publish_ms = now
            if state.rebuild is not None:
                self._rebuild_one(record, state, state.rebuild, routes, publish_ms, sent[topic], payloads)
                state.next_offset = offset + 1
                continue
            rule = rules.get(topic)
            if rule is None:
                rule = rules[topic] = routes.rule(self._retention_ms.get(topic))
            if state.rule is not rule:
                state.rules.note(offset, rule)
                state.rule = rule
            headers = record.headers()
            fate = NOW if headers is None and routes.plain else self._judge(rule, headers, publish_ms)
            state.next_offset = offset + 1
            if fate.rejected is not None:
                route = routes.route
                self._writer.dead_letter(route.dead_letter_topic, record, fate.rejected.code, fate.rejected.message)
                self._metrics.rejected.labels(topic, route.namespace or "", fate.rejected.code).inc()
                continue
            if fate.overridden:
                self._metrics.fixed_delay_overridden.labels(topic, routes.route.namespace or "").inc()
            if fate.disabled:
                self._metrics.delay_disabled.labels(topic, routes.route.namespace or "").inc()
            if fate.miscased:
                self._metrics.delay_header_miscased.labels(topic).inc()
            subs = sent[topic]
            deliver_at = fate.deliver_at
            if deliver_at is None:
                self._delivery.send(routes.delayed, record, publish_ms, subs)
            else:
                runs = state.runs
                joined = False
                if deliver_at > now and stamped and self._runs:
                    joined, dropped = runs.offer(offset, deliver_at, record)
                    if dropped:
                        self._index(state, routes, dropped, now, payloads, subs)
                    if joined:
                        counts_delayed[topic] += 1
                        offered[(topic, partition)] = state
                elif runs.open and runs.would_join(deliver_at):
                    # Due already, so not a member; a reread would count it as one: the run ends before it.
                    self._index(state, routes, runs.close(), now, payloads, subs)
                if not joined and self._index(state, routes, [(offset, deliver_at, record)], now, payloads, subs):
                    counts_delayed[topic] += 1
            if routes.ordered:
                # Exclusive and failover subscriptions ignore delays: their deliver-at is the publish time.
                self._delivery.send(routes.ordered, record, publish_ms, subs)
        for state in offered.values():
            if dropped := state.runs.settle():
                routes = routes_now.get(state.topic)
                if routes is not None:
                    self._index(state, routes, dropped, now, payloads, sent[state.topic])
        if payloads is not None:
            payloads.write()
        if nacks_due:
            self._redelivery.redeliver(nacks_due)
        self._writer.poll()
        for topic, n in counts_in.items():
            self._metrics.messages_in.labels(topic).inc(n)
        for topic, n in counts_delayed.items():
            self._metrics.messages_delayed.labels(topic).inc(n)
        for topic, subs in sent.items():
            for sub, n in subs.items():
                self._metrics.child(self._metrics.delivered, topic, sub).inc(n)

    def rejudge(self, partition: TopicPartitionKey, record: Message) -> int | None:
        """The deliver-at intake gave `record` (for reading runs back), or None: not delayed, or no timestamp."""
        state = self._partitions.get(partition)
        routes = self._routes().get(partition[0])
        publish_ms = record.timestamp()[1]
        if state is None or routes is None or publish_ms <= 0:
            return None
        rule = state.rules.at(record.offset()) or routes.rule(self._retention_ms.get(partition[0]))
        return self._judge(rule, record.headers(), publish_ms).deliver_at

    def _index(
        self,
        state: PartitionState,
        routes: Routes,
        records: list[tuple[int, int, Message]],
        now: int,
        payloads: CacheBatch | None,
        sent: Counter[str],
    ) -> int:
        """Index delayed records one by one, keeping their payloads; one due now is sent now.

        Returns how many were indexed."""
        tracker, indexed = state.tracker, 0
        hold_from = state.runs.lower_bound()
        partition = (state.topic, state.partition)
        for offset, deliver_at, record in records:
            if tracker.add(offset, deliver_at, hold_from):
                indexed += 1
                near = self._dispatcher.near(deliver_at, now)
                kept = near and self._dispatcher.keep_payload(partition, offset, record)
                if not kept and payloads is not None:
                    payloads.add(state.topic, state.partition, offset, deliver_at, record, record.headers())
            else:
                self._delivery.send(routes.delayed, record, deliver_at, sent)
        return indexed

    def _rebuild_one(
        self,
        record: Message,
        state: PartitionState,
        rebuild: Rebuild,
        routes: Routes,
        publish_ms: int,
        sent: Counter[str],
        payloads: CacheBatch | None,
    ) -> None:
        """One record of a rebuild: indexed again (with its payload cached, as at intake: a new
        owner has no cache) or sent now if due, unless the watermark says it was delivered."""
        offset = record.offset()
        rule = state.rules.at(offset) or routes.rule(self._retention_ms.get(record.topic()))
        fate = judge(rule, record.headers(), publish_ms)
        deliver_at = fate.deliver_at
        if deliver_at is not None and pack(deliver_at, offset) > rebuild.through:
            if state.tracker.add(offset, deliver_at, deliver_now=not state.exact):
                rebuild.indexed += 1
                if payloads is not None:
                    payloads.add(state.topic, state.partition, offset, deliver_at, record, record.headers())
            else:
                self._delivery.send(routes.targets(rule), record, deliver_at, sent)
                rebuild.redelivered += 1
        self._metrics.replayed.labels(record.topic()).inc()
        if rebuild.progress(state.name, offset):
            state.rebuild = None

    def _consumer_error(self, error: KafkaError) -> None:
        if error.fatal():
            raise BrokerError(f"the inbound consumer failed for good: {error}; restart the sidecar")
        logger.warning("consumer error error=%s", error)
