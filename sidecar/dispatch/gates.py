"""The gates of keyed partitions (partitions/keyed.py) for the dispatcher, and the clock records
that open them.

An entry of a keyed partition goes only once the partition's log holds a record stamped at or
after its deliver-at: that is what makes "was it still pending when the newer record came?" a
question the log answers (policy/by_key.py). On a busy partition producers' records move the
clock; on an idle one the sidecar appends a record of its own, marked like a cancel's request
(`delay-command-by`, then `delay-clock`) so that consumers of the inbound topic, other groups and
the audit skip it. It is stamped a little ahead (partitions/keyed.py: CLOCK_LEAD_MS), so that it is
in the log when the entries fall due; with LogAppendTime the broker stamps it when it is appended.
"""

from collections.abc import Iterable

from sidecar.clock import Clock
from sidecar.control.cancels import COMMAND_BY
from sidecar.dispatch.dispatcher import Gates
from sidecar.outbound.writer import Writer
from sidecar.partitions.state import PartitionState

CLOCK = "delay-clock"
"""Second header of a clock record."""


class KeyedGates:
    def __init__(self, writer: Writer, group_id: str, clock: Clock) -> None:
        self._writer = writer
        self._headers = [(COMMAND_BY, group_id.encode()), (CLOCK, b"")]
        self._clock = clock

    def of(self, states: Iterable[PartitionState]) -> Gates:
        """The latest deliver-at each keyed partition may deliver now."""
        now = self._clock.now_ms()
        return {(s.topic, s.partition): s.keyed.gate(now) for s in states if s.keyed is not None}

    def wake_ms(self, states: Iterable[PartitionState]) -> int | None:
        """When the loop must run to write the next clock record, if any is wanted."""
        times = [
            at
            for s in states
            if s.keyed is not None and (at := s.keyed.clock_due_at(s.tracker.next_delivery_time())) is not None
        ]
        return min(times, default=None)

    def wind(self, states: Iterable[PartitionState]) -> None:
        """A clock record for each keyed partition whose due entries wait for one."""
        now = self._clock.now_ms()
        for state in states:
            keyed = state.keyed
            if keyed is None:
                continue
            stamp = keyed.clock_wanted(state.tracker.next_delivery_time(), now)
            if stamp is not None:
                self._writer.send(state.topic, None, None, list(self._headers), state.partition, stamp)
                keyed.clock_sent_ms = now
