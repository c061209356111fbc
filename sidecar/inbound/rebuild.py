"""Records below a rebuild's end, read again because the partition's index was not kept.

They were judged before the restart: each is judged again with the rule recorded for its offset,
and only those the committed watermark does not cover are indexed again (with their payloads
cached, as at intake: a new owner has no cache) or, when due, sent now.
"""

from collections.abc import Sequence

from confluent_kafka import Message

from sidecar.control.cancels import is_marked
from sidecar.inbound.batch import IntakeBatch
from sidecar.inbound.commands import CommandStep
from sidecar.inbound.keys import KeyedIntake, is_keyed
from sidecar.metrics import Metrics
from sidecar.outbound.delivery import Delivery
from sidecar.partitions.state import PartitionState
from sidecar.policy.intake import judge
from sidecar.policy.routes import Routes
from sidecar.tracker.base import pack


class Rebuilder:
    def __init__(
        self, delivery: Delivery, retention_ms: dict[str, int | None], metrics: Metrics, commands: CommandStep
    ) -> None:
        self._commands = commands
        self._keys = KeyedIntake(metrics)
        self._delivery = delivery
        self._retention_ms = retention_ms
        self._metrics = metrics

    def take(self, batch: IntakeBatch, state: PartitionState, routes: Routes, records: Sequence[Message]) -> int:
        """Rebuild from the first of `records` on; returns how many it took (the rest come after the rebuild)."""
        rebuild = state.rebuild
        taken = 0
        sent = batch.sent[state.topic]
        current = batch.rule(state.topic, routes, self._retention_ms.get(state.topic))
        for record in records:
            if rebuild is None:
                break
            offset = record.offset()
            headers = record.headers()
            rule = state.rules.at(offset) or current
            keyed = is_keyed(state, rule)
            if is_marked(headers):
                if keyed:
                    self._keys.note(state, [record])
                self._commands.replay(state, record, rebuild.through)
                deliver_at = None
            else:
                publish_ms = record.timestamp()[1]
                fate = judge(rule, headers, publish_ms if publish_ms > 0 else batch.now)
                deliver_at = fate.deliver_at
                if keyed and self._keys.decide(state, rule, [record], [publish_ms], [fate]) == [False]:
                    deliver_at = None  # a tombstone that cancels
            if deliver_at is not None and pack(deliver_at, offset) > rebuild.through:
                # Nothing goes out while a cancel read later in the log may still take it back,
                # nor, on a keyed topic, before the log's clock reaches it (the gate).
                deliver_now = not state.exact and state.hold_until is None and not keyed
                if state.tracker.add(offset, deliver_at, deliver_now=deliver_now):
                    rebuild.indexed += 1
                    if batch.payloads is not None:
                        batch.payloads.add(state.topic, state.partition, offset, deliver_at, record)
                else:
                    due = [(deliver_at, offset, record)]
                    self._delivery.send_many((state.topic, state.partition), routes.targets(rule), due, sent)
                    rebuild.redelivered += 1
            state.next_offset = offset + 1
            taken += 1
            if rebuild.progress(state.name, offset):
                state.rebuild = rebuild = None
        self._metrics.child(self._metrics.replayed, state.topic).inc(taken)
        return taken
