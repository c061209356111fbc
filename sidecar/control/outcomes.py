"""The one answer each cancel and reschedule gets, on `<control topic>.outcomes`, keyed like the command.

Written by whichever step decides: the control partition's owner when it refuses a command on its
own, the inbound partition's owner otherwise. In exactly-once mode the answer is part of the
transaction that commits the decision, so a reader with isolation.level=read_committed sees one
answer per command.
"""

from sidecar.control.cancels import OUTCOMES_SUFFIX, OutcomeRecord
from sidecar.metrics import Metrics
from sidecar.outbound.writer import Writer


class Outcomes:
    def __init__(self, writer: Writer, metrics: Metrics) -> None:
        self._writer = writer
        self._metrics = metrics

    def send(self, key: bytes | None, outcome: OutcomeRecord) -> None:
        """To the outcomes topic of the control topic the command came on."""
        self._writer.send(outcome.source[0] + OUTCOMES_SUFFIX, key, outcome.encode(), [])
        self._metrics.child(self._metrics.commands, outcome.kind or "unknown", outcome.outcome).inc()
