"""Delayed records into the partition's index, one entry each, with the payload kept (in memory
when near due, else in the payload cache). A record already due when it is indexed (the tracker
refuses it) goes out at once.
"""

from confluent_kafka import Message

from sidecar.dispatch.dispatcher import Dispatcher
from sidecar.inbound.batch import IntakeBatch
from sidecar.outbound.delivery import Delivery, Due
from sidecar.partitions.state import PartitionState
from sidecar.policy.routes import Routes

Delayed = tuple[int, int, Message]
"""(offset, deliver-at, record)"""


class Indexer:
    def __init__(self, dispatcher: Dispatcher, delivery: Delivery) -> None:
        self._dispatcher = dispatcher
        self._delivery = delivery

    def take(
        self, batch: IntakeBatch, state: PartitionState, routes: Routes, delayed: list[Delayed], gated: bool = False
    ) -> None:
        """Delayed records of one partition in offset order: each into the tracker, keeping its
        payload; one due now is sent now, unless `gated` (a keyed partition: the gate of
        dispatch/dispatcher.py lets it go once the log's clock reaches it)."""
        partition = (state.topic, state.partition)
        sent = batch.sent[state.topic]
        tracker = state.tracker
        refused = tracker.add_many([r[0] for r in delayed], [r[1] for r in delayed], deliver_now=not gated)
        if refused:
            due: list[Due] = [(at, offset, record) for offset, at, record in map(delayed.__getitem__, refused)]
            # On a keyed partition too: the gate let a pop past their deliver-at, so the log's
            # clock had reached it before they were read, and no record can replace them.
            self._delivery.send_many(partition, routes.delayed, due, sent)
            gone = set(refused)
            delayed = [r for i, r in enumerate(delayed) if i not in gone]
        keep = self._dispatcher.keep_payload
        near = batch.now + self._dispatcher.read_ahead_ms  # kept in memory, else in the payload cache
        later = [r for r in delayed if r[1] > near or not keep(partition, r[0], r[2])]
        if later and batch.payloads is not None:
            batch.payloads.add_many(state.topic, state.partition, later)
        batch.delayed[state.topic] += len(delayed)
