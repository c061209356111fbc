"""Delayed records into the partition's index: as members of a monotone run, or one entry each
with the payload kept (in memory when near due, else in the payload cache). A record already
due when it is indexed (the tracker refuses it) goes out at once.
"""

from collections import Counter

from confluent_kafka import Message

from sidecar.dispatch.dispatcher import Dispatcher
from sidecar.inbound.batch import IntakeBatch
from sidecar.outbound.delivery import Delivery, Due
from sidecar.partitions.state import PartitionState
from sidecar.policy.routes import Routes

Delayed = tuple[int, int, Message]
"""(offset, deliver-at, record)"""


class Indexer:
    def __init__(self, dispatcher: Dispatcher, delivery: Delivery, runs: bool) -> None:
        """`runs`: form monotone runs at intake (runs already pending are delivered either way)."""
        self._dispatcher = dispatcher
        self._delivery = delivery
        self._runs = runs

    def take(
        self, batch: IntakeBatch, state: PartitionState, routes: Routes, delayed: list[tuple[Delayed, bool]]
    ) -> None:
        """Delayed records of one partition in offset order, each with whether it has a timestamp of its own
        (a run needs one: a reread judges it again from it)."""
        now, runs = batch.now, state.runs
        sent = batch.sent[state.topic]
        if not self._runs and not runs.open:  # no run to offer to or to close: the slice in one step
            batch.delayed[state.topic] += self.index(batch, state, routes, [item for item, _ in delayed], sent)
            return
        indexed = 0
        for item, stamped in delayed:
            offset, deliver_at, record = item
            if deliver_at > now and stamped and self._runs:
                joined, dropped = runs.offer(offset, deliver_at, record)
                if dropped:  # counted when they joined
                    self.index(batch, state, routes, dropped, sent)
                if joined:
                    indexed += 1
                    batch.offered[(state.topic, state.partition)] = state
                    continue
            elif runs.open and runs.would_join(deliver_at):
                # Due already, so not a member; a reread would count it as one: the run ends before it.
                self.index(batch, state, routes, runs.close(), sent)
            indexed += self.index(batch, state, routes, [item], sent)
        batch.delayed[state.topic] += indexed

    def settle(self, batch: IntakeBatch) -> None:
        """At the end of a batch, runs still on probation are indexed one by one (see Runs.settle)."""
        for state in batch.offered.values():
            if dropped := state.runs.settle():
                routes = batch.routes.get(state.topic)
                if routes is not None:
                    self.index(batch, state, routes, dropped, batch.sent[state.topic])

    def index(
        self, batch: IntakeBatch, state: PartitionState, routes: Routes, records: list[Delayed], sent: Counter[str]
    ) -> int:
        """Each record into the tracker, keeping its payload; one due now is sent now. Returns how many were indexed."""
        partition = (state.topic, state.partition)
        refused = state.tracker.add_many([r[0] for r in records], [r[1] for r in records], state.runs.lower_bound())
        if refused:
            due: list[Due] = [(at, offset, record) for offset, at, record in map(records.__getitem__, refused)]
            self._delivery.send_many(partition, routes.delayed, due, sent)
            gone = set(refused)
            records = [r for i, r in enumerate(records) if i not in gone]
        keep = self._dispatcher.keep_payload
        near = batch.now + self._dispatcher.read_ahead_ms  # kept in memory, else in the payload cache
        later = [r for r in records if r[1] > near or not keep(partition, r[0], r[2])]
        if later and batch.payloads is not None:
            batch.payloads.add_many(state.topic, state.partition, later)
        return len(records)
