"""The first step: a consumed batch cut into slices of one partition each, handed on whole.

Control partitions go to the control intake, partitions being rebuilt to the rebuild until it
ends, the rest to admission (judge, send, dead-letter, index). Every per-batch cost (the payload
cache write, the producer's poll, the counters) is paid once, in `take`, after the slices.
"""

import logging
from collections.abc import Callable

from confluent_kafka import KafkaError, Message

from sidecar.control.intake import ControlIntake
from sidecar.errors import ConsumerFailed
from sidecar.inbound.admission import Admission
from sidecar.inbound.batch import IntakeBatch
from sidecar.inbound.rebuild import Rebuilder
from sidecar.kafka_io import is_fatal
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState

logger = logging.getLogger(__name__)


class Receiver:
    def __init__(
        self,
        partitions: dict[TopicPartitionKey, PartitionState],
        batches: Callable[[], IntakeBatch],
        admission: Admission,
        rebuilder: Rebuilder,
        control: ControlIntake,
        poll: Callable[[], None],
        keep: Callable[[TopicPartitionKey, list[Message]], None],
    ) -> None:
        """`batches` opens each batch (inbound/batch.py); `poll` serves the producer's delivery reports;
        `keep` is handed each inbound slice, for redeliveries (dispatch/recent.py)."""
        self._partitions = partitions
        self._batches = batches
        self._admission = admission
        self._rebuilder = rebuilder
        self._control = control
        self._poll = poll
        self._keep = keep

    def take(self, records: list[Message]) -> None:
        batch = self._batches()
        for state, chunk in self._slices(records):
            if state.control:
                self._control.take(state, chunk)
                continue
            routes = batch.routes.get(state.topic)
            if routes is None:
                continue  # the topic left the policies; its pending records are drained to its dead-letter topic
            batch.received[state.topic] += len(chunk)
            self._keep((state.topic, state.partition), chunk)
            taken = self._rebuilder.take(batch, state, routes, chunk) if state.rebuild is not None else 0
            if taken < len(chunk):
                self._admission.take(batch, state, routes, chunk[taken:])
        batch.settle()
        self._control.settle()
        self._poll()

    def _slices(self, records: list[Message]) -> list[tuple[PartitionState, list[Message]]]:
        """Consecutive records of one served partition, in consumed order; errors reported, revoked skipped."""
        slices: list[tuple[PartitionState, list[Message]]] = []
        key: TopicPartitionKey | None = None
        state: PartitionState | None = None
        chunk: list[Message] = []
        for record in records:
            error = record.error()
            if error is not None:
                self._consumer_error(error)
                continue
            here = (record.topic(), record.partition())
            if here != key:
                key, state = here, self._partitions.get(here)
                if state is not None:  # else revoked: not ours to commit any more
                    chunk = []
                    slices.append((state, chunk))
            if state is not None:
                chunk.append(record)
        return slices

    def _consumer_error(self, error: KafkaError) -> None:
        if is_fatal(error):
            raise ConsumerFailed(f"the inbound consumer failed for good: {error}; restart the sidecar")
        logger.warning("consumer error error=%s", error)
