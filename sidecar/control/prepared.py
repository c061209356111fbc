"""Nack redeliveries built ahead of their deliver-at, held until it comes or they go stale.

A burst of nacks is accepted well before it falls due, and what must keep up with the rate they
fall due at is the loop's work at due time. So the redelivery of a nack accepted shortly before its
deliver-at is built when it is accepted (redelivery.py, `Redelivery.prepare`): its message found
among the records kept since intake, judged again, its headers made. At due time only the write is
left. What is built is only a cache of that work:

- it is used only when its acceptance is claimed at due time, so a nack superseded or cancelled
  meanwhile never uses it, and it is dropped PREPARED_GRACE_MS after its deliver-at;
- a policy change drops all of it (a subscription may have left, a rule changed);
- a revoked inbound partition drops its part (its topic may even be deleted and created again).
"""

from sidecar.clock import Clock
from sidecar.control.commands import AcceptedNack, ControlPosition
from sidecar.outbound.records import OutHeaders
from sidecar.partitions import TopicPartitionKey
from sidecar.policy.routes import Routes

PREPARE_AHEAD_MS = 5_000
"""Nacks accepted this long or less before their deliver-at are built at acceptance."""
MAX_PREPARED = 100_000
"""Redeliveries held at most (each holds its message's key, value and headers)."""
PREPARED_GRACE_MS = 5_000
"""One still held this long after its deliver-at will not be claimed any more: dropped."""

Out = tuple[str, int, bytes | None, bytes | None, OutHeaders]
"""A redelivery as it is written: (outbound topic, outbound partition, key, value, headers)."""
AcceptanceKey = tuple[ControlPosition, str]
"""An acceptance: its command's position and its subscription (a reschedule has one per subscription)."""


def key_of(nack: AcceptedNack) -> AcceptanceKey:
    return (nack.source, nack.command.subscription)


class Prepared:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._ready: dict[AcceptanceKey, tuple[int, TopicPartitionKey, Out]] = {}
        """Acceptance -> (its deliver-at, its message's inbound partition, what to write)."""
        self._routes: dict[str, Routes] | None = None
        """The routes they were built with."""
        self._sweep_at = 0

    def __len__(self) -> int:
        return len(self._ready)

    def __contains__(self, nack: AcceptedNack) -> bool:
        return key_of(nack) in self._ready

    def under(self, routes: dict[str, Routes]) -> None:
        """The policies in force now: what was built under others is dropped."""
        if routes is not self._routes:
            self._ready.clear()
            self._routes = routes

    @property
    def room(self) -> int:
        """How many more may be held."""
        return MAX_PREPARED - len(self._ready)

    def put(self, nack: AcceptedNack, partition: TopicPartitionKey, out: Out) -> None:
        self._ready[key_of(nack)] = (nack.deliver_at, partition, out)

    def pop(self, nack: AcceptedNack) -> Out | None:
        """What was built for this acceptance, now claimed (None: build it now)."""
        held = self._ready.pop(key_of(nack), None) if self._ready else None
        return None if held is None else held[2]

    def sweep(self) -> None:
        """Drop what was built for acceptances that will never be claimed: superseded or cancelled
        before due, or whose control partition left. Once a second at most."""
        if not self._ready:
            return
        now = self._clock.now_ms()
        if now < self._sweep_at:
            return
        self._sweep_at = now + 1000
        gone = now - PREPARED_GRACE_MS
        for key in [key for key, (deliver_at, _, _) in self._ready.items() if deliver_at < gone]:
            del self._ready[key]

    def forget(self, partition: TopicPartitionKey) -> None:
        """An inbound partition gone to another member: what was built from its records goes."""
        if self._ready:
            self._ready = {k: v for k, v in self._ready.items() if v[1] != partition}
