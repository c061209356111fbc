"""Which pending deliveries of one inbound partition cancels and reschedules took back. Pure code.

The tracker is shared by every subscription and knows positions only, so a cancel does not touch
it: the entry stays and comes out at its time, and this table says which subscriptions it no
longer goes to. A reschedule takes the message back the same way and adds a *copy*: its request
(a record of the same partition holding the message, see cancels.py) indexed at the new time.

A delivery of (message, subscription) has one *carrier* at a time: the original offset, or the
copy the latest reschedule made. A request is in time when its carrier is still indexed and still
goes to that subscription; the decision is taken once, when the inbound owner reads the request,
and written down as a Fact. A rebuild applies the facts again in log order, and a fact whose
carrier is no longer pending changes nothing: it was delivered (or taken back) before the commit.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from sidecar.control.cancels import (
    ALREADY_CANCELLED,
    CANCELLED,
    RESCHEDULED,
    TOO_LATE,
    UNKNOWN_MESSAGE_OUTCOME,
    Fact,
    Request,
)

REMEMBERED = 100_000
"""Cancelled offsets per partition kept after they left the index, for the lookup (about 100 bytes each)."""


@dataclass(frozen=True)
class Copy:
    origin: int
    deliver_at: int
    subs: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    """A request decided: the outcome, and the fact to write and apply when it changed something."""

    outcome: str
    subscriptions: tuple[str, ...] = ()
    too_late: tuple[str, ...] = ()
    delivered: tuple[int, ...] = ()
    """Carriers (offsets) that went out before the request: where to look up when they went."""
    fact: Fact | None = None
    code: str | None = None
    message: str | None = None


def with_taken_nacks(decision: Decision, kind: str, nacks: tuple[str, ...]) -> Decision:
    """A cancel (reschedule) whose control partition's owner took back (moved) pending nack
    redeliveries for `nacks`: those subscriptions are cancelled (rescheduled), whatever the first
    delivery did (it went out: it was nacked)."""
    if not nacks:
        return decision
    outcome = CANCELLED if kind == "cancel" else RESCHEDULED
    if decision.outcome not in (outcome, TOO_LATE):
        return Decision(outcome, nacks)
    subscriptions = (*decision.subscriptions, *(s for s in nacks if s not in decision.subscriptions))
    too_late = tuple(s for s in decision.too_late if s not in nacks)
    return replace(decision, outcome=outcome, subscriptions=subscriptions, too_late=too_late)


Indexed = Callable[[int], bool]
"""Whether the tracker still holds this offset (not yet delivered)."""


class Overrides:
    def __init__(self) -> None:
        self.suppressed: dict[int, tuple[str, ...]] = {}
        """Carrier offset -> subscriptions it no longer goes to."""
        self.copies: dict[int, Copy] = {}
        """Copy (request offset) still indexed -> what it delivers."""
        self._carrier: dict[int, dict[str, int]] = {}
        """Message offset -> subscription -> its copy, once rescheduled."""
        self._done: dict[int, int] = {}
        """Copy delivered -> its deliver-at, while its message may still be asked about."""
        self._gone: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        """Offsets that came out of the index taken back from these subscriptions, the latest
        REMEMBERED of them: what the lookup answers `cancelled` for once nothing else says so."""

    def __bool__(self) -> bool:
        return bool(self.suppressed or self.copies)

    def decide(self, request_offset: int, request: Request, owed: tuple[str, ...], indexed: Indexed) -> Decision:
        """Decide a request for the message at request.offset, owed at intake to `owed` (its delayed
        subscriptions). Applies nothing: the caller writes the fact, then `apply`s it."""
        origin = request.offset
        if request.subscription is not None:
            if request.subscription not in owed:
                return Decision(
                    UNKNOWN_MESSAGE_OUTCOME,
                    message=f"{origin} was never owed to {request.subscription!r} with a delay",
                )
            subs: Iterable[str] = (request.subscription,)
        else:
            subs = owed
        taken: list[tuple[int, str]] = []
        late: list[str] = []
        delivered: list[int] = []
        cancelled_before: list[str] = []
        for sub in subs:
            carrier = self._carrier.get(origin, {}).get(sub, origin)
            if self._goes_to(carrier, origin, sub, indexed):
                taken.append((carrier, sub))
            elif self._pending(carrier, origin, indexed):
                cancelled_before.append(sub)  # still indexed, but already taken back from `sub`
            else:
                late.append(sub)
                delivered.append(carrier)
        if not taken:
            if cancelled_before and request.kind == "cancel":
                return Decision(CANCELLED, tuple(cancelled_before), tuple(late), tuple(delivered))
            if cancelled_before and not late:
                return Decision(
                    "rejected", code=ALREADY_CANCELLED, message=f"{origin} was cancelled; it cannot be rescheduled"
                )
            return Decision(TOO_LATE, (), tuple(late), tuple(delivered))
        subscriptions = tuple(s for _, s in taken)
        if request.kind == "cancel":
            fact = Fact(origin, request_offset, tuple(taken))
            return Decision(CANCELLED, subscriptions, tuple(late), tuple(delivered), fact)
        assert request.deliver_at is not None
        fact = Fact(origin, request_offset, tuple(taken), request.deliver_at, subscriptions)
        return Decision(RESCHEDULED, subscriptions, tuple(late), tuple(delivered), fact)

    def apply(self, fact: Fact, indexed: Indexed, copy_pending: bool = True) -> None:
        """Take a decided fact into the table. `copy_pending`: the copy is (or is about to be) indexed;
        False in a rebuild that finds it delivered before the commit."""
        origin = fact.origin
        for carrier, sub in fact.suppress:
            if self._pending(carrier, origin, indexed):
                held = self.suppressed.get(carrier, ())
                if sub not in held:
                    self.suppressed[carrier] = (*held, sub)
        if fact.copy is None:
            return
        carriers = self._carrier.setdefault(origin, {})
        for sub in fact.subs:
            carriers[sub] = fact.copy
        if copy_pending:
            assert fact.deliver_at is not None
            self.copies[fact.copy] = Copy(origin, fact.deliver_at, fact.subs)
        elif fact.deliver_at is not None:
            self._done[fact.copy] = fact.deliver_at

    def take_copies(self, origin: int) -> list[int]:
        """The pending copies of a message that a newer record of its key replaced: no longer
        pending here (the caller sets them aside like the message itself)."""
        taken = [copy for copy in self._carrier.get(origin, {}).values() if self.copies.pop(copy, None) is not None]
        return taken

    def delivered_at(self, carrier: int) -> int | None:
        """A delivered copy's deliver-at (None: not a copy this table knows)."""
        return self._done.get(carrier)

    def popped(self, offset: int, owed: tuple[str, ...], indexed: Indexed) -> tuple[tuple[str, ...], Copy | None]:
        """An entry came out of the tracker: (subscriptions it goes to, the copy it is or None).

        For a copy, `owed` is ignored: it goes to the subscriptions whose latest reschedule it is."""
        held = self.suppressed.pop(offset, ())
        copy = self.copies.pop(offset, None)
        if copy is None:
            if held:
                self._remember(offset, held)
                self._forget(offset, indexed)
            return (tuple(s for s in owed if s not in held) if held else owed), None
        self._done[offset] = copy.deliver_at
        carriers = self._carrier.get(copy.origin, {})
        subs = tuple(s for s in copy.subs if carriers.get(s) == offset and s not in held)
        self._forget(copy.origin, indexed)
        return subs, copy

    def recently_cancelled(self, offset: int) -> tuple[str, ...]:
        """Subscriptions an offset went out without, if it is among the last REMEMBERED taken back."""
        return self._gone.get(offset, ())

    def copy_for(self, origin: int, sub: str) -> tuple[int, int, bool] | None:
        """(copy offset, its deliver-at, still pending) of the latest reschedule of (message, subscription)."""
        copy = self._carrier.get(origin, {}).get(sub)
        if copy is None:
            return None
        pending = self.copies.get(copy)
        if pending is not None:
            return copy, pending.deliver_at, True
        done = self._done.get(copy)
        return (copy, done, False) if done is not None else None

    def _remember(self, offset: int, held: tuple[str, ...]) -> None:
        self._gone[offset] = held
        if len(self._gone) > REMEMBERED:
            self._gone.popitem(last=False)

    def _pending(self, carrier: int, origin: int, indexed: Indexed) -> bool:
        if carrier == origin:
            return indexed(origin)
        return carrier in self.copies

    def _goes_to(self, carrier: int, origin: int, sub: str, indexed: Indexed) -> bool:
        if sub in self.suppressed.get(carrier, ()):
            return False
        if carrier == origin:
            return indexed(origin)
        copy = self.copies.get(carrier)
        return copy is not None and sub in copy.subs

    def _forget(self, origin: int, indexed: Indexed) -> None:
        """Once neither the message nor any copy of it is pending, nothing about it is needed."""
        carriers = self._carrier.get(origin)
        if carriers is None or indexed(origin) or origin in self.suppressed:
            return
        if any(copy in self.copies for copy in carriers.values()):
            return
        for copy in self._carrier.pop(origin).values():
            self._done.pop(copy, None)
