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
from sidecar.policy.intake import Fate, judge
from sidecar.policy.routes import IntakeRule, Routes
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
        """Rebuild from the first of `records` on; returns how many it took (the rest come after the rebuild).

        Records are judged one by one, but a run of them under one rule goes through the keyed step
        at once, as at intake: a keyed partition is read again at 133,000 records a second, against
        56,000 one at a time (docs/benchmarks.md). A run ends before each command record: its replay
        may cancel a record of the run, or move the time a later record of its key is judged against."""
        rebuild = state.rebuild
        if rebuild is None:
            return 0
        until = rebuild.until
        last = next((i for i, record in enumerate(records) if record.offset() + 1 >= until), len(records) - 1)
        current = batch.rule(state.topic, routes, self._retention_ms.get(state.topic))
        run: list[Message] = []
        fates: list[Fate] = []
        rule = current
        for record in records[: last + 1]:
            headers = record.headers()
            at = state.rules.at(record.offset()) or current
            if run and (at is not rule or is_marked(headers)):
                self._index(batch, state, routes, rule, run, fates)
                run, fates = [], []
            rule = at
            if is_marked(headers):
                if is_keyed(state, rule):
                    self._keys.note(state, [record])
                self._commands.replay(state, record, rebuild.through)
                self._advance(state, record.offset())
                continue
            publish_ms = record.timestamp()[1]
            run.append(record)
            fates.append(judge(rule, headers, publish_ms if publish_ms > 0 else batch.now))
        if run:
            self._index(batch, state, routes, rule, run, fates)
        taken = last + 1
        self._metrics.child(self._metrics.replayed, state.topic).inc(taken)
        return taken

    def _index(
        self,
        batch: IntakeBatch,
        state: PartitionState,
        routes: Routes,
        rule: IntakeRule,
        records: list[Message],
        fates: list[Fate],
    ) -> None:
        """A run of records under one rule, none a command: each one not delivered before (past the
        committed watermark) into the index again, or sent now when due."""
        rebuild = state.rebuild
        assert rebuild is not None
        keyed = is_keyed(state, rule)
        delivered: list[bool] | None = None
        if keyed:
            delivered = self._keys.decide(state, rule, records, [r.timestamp()[1] for r in records], fates)
        sent = batch.sent[state.topic]
        # Nothing goes out while a cancel read later in the log may still take it back, nor, on a
        # keyed topic, before the log's clock reaches it (the gate).
        deliver_now = not state.exact and state.hold_until is None and not keyed
        for i, (record, fate) in enumerate(zip(records, fates, strict=True)):
            offset = record.offset()
            deliver_at = fate.deliver_at if delivered is None or delivered[i] else None  # a tombstone cancels
            if deliver_at is not None and pack(deliver_at, offset) > rebuild.through:
                if state.tracker.add(offset, deliver_at, deliver_now=deliver_now):
                    rebuild.indexed += 1
                    if batch.payloads is not None:
                        batch.payloads.add(state.topic, state.partition, offset, deliver_at, record)
                else:
                    due = [(deliver_at, offset, record)]
                    self._delivery.send_many((state.topic, state.partition), routes.targets(rule), due, sent)
                    rebuild.redelivered += 1
            self._advance(state, offset)

    @staticmethod
    def _advance(state: PartitionState, offset: int) -> None:
        state.next_offset = offset + 1
        if state.rebuild is not None and state.rebuild.progress(state.name, offset):
            state.rebuild = None
