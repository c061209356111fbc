"""The control partitions' records in a consumed batch: commands judged and accepted records
indexed (acceptance.py); at the slice's end, the accepted records are written, the redeliveries of
the nacks accepted for soon are built (redelivery.py, `prepare`), and the accepted nacks already
due are redelivered (those whose payloads must be read back from the log, at the
end of the consumed batch: the engine releases them).
"""

from collections.abc import Sequence

from confluent_kafka import Message

from sidecar.control.acceptance import Acceptance
from sidecar.control.commands import AcceptedNack
from sidecar.control.redelivery import Redelivery
from sidecar.partitions.state import PartitionState


class ControlIntake:
    def __init__(self, acceptance: Acceptance, redelivery: Redelivery) -> None:
        self._acceptance = acceptance
        self._redelivery = redelivery
        self._due: list[tuple[int, AcceptedNack]] = []

    def take(self, state: PartitionState, records: Sequence[Message]) -> None:
        due: list[tuple[int, AcceptedNack]] = []
        for record in records:
            self._acceptance.take(record, state, due)
        self._due += due

    def settle(self) -> None:
        self._acceptance.write()
        self._acceptance.count()
        self._redelivery.prepare(self._acceptance.indexed())
        if self._due:
            due, self._due = self._due, []
            self._redelivery.redeliver(due, hold_reads=True)  # released at the end of the consumed batch
