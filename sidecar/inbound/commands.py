"""Requests and facts in an inbound partition: cancels and reschedules decided where the message is delivered.

A request is decided when it is read, in log order, by the only member that delivers from the
partition, so "cancelled" and "delivered" cannot both happen (control/cancels.py). A decision that
changes something is written down as a fact in the same partition and taken into the partition's
overrides at once; the fact comes back later through intake and is skipped then, unless an earlier
owner wrote it. A rebuild applies facts again and skips requests, which were decided already.

A member that takes a partition over reads past the commit what the earlier owner appended since:
requests it decided, and further on the facts it wrote for them. While the partition is held
(`PartitionState.hold_until`, the end at assignment) requests are set aside; when the hold ends
(partitions/holds.py, by the consumer's position: the log can end in a transaction marker that no
record reaches), those that no earlier fact names are decided, in log order, before anything is
delivered, and before any request read past that end. Deciding them as they came had answered a
cancel twice after a handoff (the churn bench, at least once).

A request by key (a command that named its message by key, on a keyed topic) is for the key's
newest record read before the request, found in the partition's key index; a partition that read
no record of the key passes the request on to the other partition the key may be on.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from confluent_kafka import Message

from sidecar.control.cancels import (
    CANCELLED,
    COMMAND_BY,
    DEAD_LETTERED,
    FACT,
    REJECTED,
    REQUEST,
    RESCHEDULED,
    TOO_LATE,
    UNKNOWN_MESSAGE_OUTCOME,
    Fact,
    OutcomeRecord,
    Request,
    is_marked,
)
from sidecar.control.outcomes import Outcomes
from sidecar.control.overrides import Decision, with_taken_nacks
from sidecar.dispatch.reader import LogReader
from sidecar.inbound.batch import IntakeBatch
from sidecar.outbound.delivery import Delivery
from sidecar.outbound.records import OutHeaders
from sidecar.outbound.writer import Writer
from sidecar.partitions.state import PartitionState
from sidecar.policy.intake import judge
from sidecar.policy.routes import IntakeRule, Routes
from sidecar.tracker.base import pack

logger = logging.getLogger(__name__)

RuleOf = Callable[[], IntakeRule]


@dataclass
class _Late:
    """A request that came too late for every subscription: its answer waits for the message's deliver-at."""

    state: PartitionState
    request: Request
    decision: Decision
    rule: IntakeRule


class CommandStep:
    def __init__(
        self,
        group_id: str,
        writer: Writer,
        delivery: Delivery,
        outcomes: Outcomes,
        reader: LogReader,
        retention_ms: dict[str, int | None],
        default_control: str,
    ) -> None:
        """`default_control`: the control topic of requests written before requests named theirs."""
        self._default_control = default_control
        self._retention_ms = retention_ms
        self._group = group_id.encode()
        self._writer = writer
        self._delivery = delivery
        self._outcomes = outcomes
        self._reader = reader
        self._late: list[_Late] = []

    def take(self, batch: IntakeBatch, state: PartitionState, routes: Routes, records: Sequence[Message]) -> None:
        """Marked records read live, in offset order."""
        for record in records:
            headers = record.headers() or []
            if headers[0][1] != self._group or len(headers) < 2:
                continue  # another sidecar group's
            name, value = headers[1]
            if name == REQUEST:
                if state.hold_until is not None and record.offset() < state.hold_until:
                    state.held_requests.append((record.offset(), value))
                    continue
                rule_of = self._rule_of(batch, state, routes)
                self._decide_set_aside(state, rule_of)  # read to the hold's end: those first, in log order
                self._decide(rule_of, state, record.offset(), value)
            elif name == FACT:
                self._fact_read(state, record.offset(), value, live=True)
        self._answer_late()

    def decide_released(self, state: PartitionState, routes: Routes | None) -> None:
        """The requests set aside while the partition was held, now that its hold is over
        (partitions/holds.py). A removed topic's (no routes) are left to its drain."""
        if state.hold_until is None and routes is not None:
            self._decide_set_aside(state, lambda: routes.rule(self._retention_ms.get(state.topic)))

    def _decide_set_aside(self, state: PartitionState, rule_of: RuleOf) -> None:
        """Each request set aside that no fact of an earlier owner names, in log order."""
        if not state.held_requests:
            return
        held, decided = state.held_requests, state.decided_earlier
        state.held_requests, state.decided_earlier = [], set()
        for offset, raw in held:
            if offset not in decided:
                self._decide(rule_of, state, offset, raw)
        self._answer_late()

    def _rule_of(self, batch: IntakeBatch, state: PartitionState, routes: Routes) -> RuleOf:
        return lambda: batch.rule(state.topic, routes, self._retention_ms.get(state.topic))

    def replay(self, state: PartitionState, record: Message, through: int) -> None:
        """A marked record read again by a rebuild: facts are applied, requests were decided before."""
        headers = record.headers() or []
        if len(headers) >= 2 and headers[0][1] == self._group and headers[1][0] == FACT:
            self._fact_read(state, record.offset(), headers[1][1], live=False, through=through)

    # ------------------------------------------------------------------ deciding a request

    def _decide(self, rule_of: RuleOf, state: PartitionState, offset: int, raw: bytes | None) -> None:
        """`rule_of`: the rule in force now, for a request about a record no rule was recorded for."""
        request = Request.decode(raw, self._default_control)
        if request is None:
            logger.error("unreadable cancel or reschedule request skipped partition=%s offset=%d", state.name, offset)
            return
        if request.by_key is not None and request.offset < 0:
            found = self._by_key(state, offset, request)
            if found is None:
                return
            request = found
        rule = state.rules.at(request.offset) or rule_of()
        tracker = state.tracker
        decision = with_taken_nacks(
            state.overrides.decide(offset, request, rule.delayed, state.indexed), request.kind, request.nacks
        )
        fact = decision.fact
        if fact is not None:
            if fact.copy is not None and state.keyed is not None:
                fact = replace(fact, key=self._key_of(state, request))
            headers: OutHeaders = [(COMMAND_BY, self._group), (FACT, fact.encode())]
            self._writer.send(state.topic, request.key, None, headers, partition=state.partition)
            state.unread_facts.add(offset)
            # On a keyed partition the copy waits for the clock like any entry (dispatch/gates.py).
            ungated = state.keyed is None
            due = fact.copy is not None and not tracker.add(offset, fact.deliver_at or 0, deliver_now=ungated)
            state.overrides.apply(fact, state.indexed)
            if due:  # rescheduled to now or the past: the copy goes out at once, read from the original
                assert fact.deliver_at is not None
                original = self._reader.read_one(state.topic, state.partition, request.offset)
                self._delivery.delayed((state.topic, state.partition), [(fact.deliver_at, offset, original)])
        if decision.outcome == TOO_LATE and not decision.subscriptions:
            self._late.append(_Late(state, request, decision, rule))
            return
        self._answer(state, request, decision)

    def _key_of(self, state: PartitionState, request: Request) -> bytes | None:
        """The key of a rescheduled message on a keyed partition (a command by offset: read from the log)."""
        if request.by_key is not None:
            return request.by_key
        message = self._reader.read_one(state.topic, state.partition, request.offset)
        key: bytes | None = message.key() if message is not None else None
        return key or None

    def _by_key(self, state: PartitionState, offset: int, request: Request) -> Request | None:
        """A command by key, read at `offset`: the request for the key's newest record read before
        it, when that record was delayed. Else the request goes on to the other partition the key
        may be on, or, from the last one, is answered."""
        assert request.by_key is not None
        newest = state.keyed.newest(request.by_key) if state.keyed is not None else None
        if newest is not None and newest[0] < offset and newest[1]:
            return replace(request, offset=newest[0])
        if newest is None and request.relay is not None and request.relay != state.partition:
            headers: OutHeaders = [(COMMAND_BY, self._group), (REQUEST, replace(request, relay=None).encode())]
            self._writer.send(state.topic, request.key, None, headers, partition=request.relay)
            return None
        if newest is None:
            why = "no record of this key was read in the partitions it may be in"
        elif newest[0] > offset:
            why = f"a newer record of this key (offset {newest[0]}) replaced it before this command was decided"
        else:
            why = f"the newest record of this key (offset {newest[0]}) is not delayed"
        self._answer(state, request, Decision(UNKNOWN_MESSAGE_OUTCOME, message=why))
        return None

    def _answer(
        self, state: PartitionState, request: Request, decision: Decision, delivered_at: int | None = None
    ) -> None:
        found = request.offset >= 0  # a command by key whose record was not found names none
        self._outcomes.send(
            request.key,
            OutcomeRecord(
                decision.outcome,  # type: ignore[arg-type]
                request.kind,
                state.topic,
                state.partition if found else None,
                request.offset if found else None,
                request.id,
                request.source,
                decision.subscriptions,
                decision.too_late,
                request.deliver_at if decision.fact is not None or decision.outcome == RESCHEDULED else None,
                delivered_at,
                decision.code,
                decision.message,
                request.nacks if decision.outcome in (CANCELLED, RESCHEDULED) else (),
                request.by_key,
            ),
        )

    def _answer_late(self) -> None:
        """Too late: say when the message was due, which the log says (one read for the batch's)."""
        if not self._late:
            return
        late, self._late = self._late, []
        wanted: dict[tuple[str, int], list[int]] = {}
        copies_at: list[int | None] = []
        for item in late:
            overrides = item.state.overrides
            at = [a for c in item.decision.delivered if (a := overrides.delivered_at(c)) is not None]
            copies_at.append(max(at) if at else None)
            if not at:
                wanted.setdefault((item.state.topic, item.state.partition), []).append(item.request.offset)
        found = {(key, offset): message for key, offset, message in self._reader.read(wanted)} if wanted else {}
        for item, copy_at in zip(late, copies_at, strict=True):
            state, request, decision = item.state, item.request, item.decision
            if copy_at is not None:
                self._answer(state, request, decision, copy_at)
                continue
            message = found.get(((state.topic, state.partition), request.offset))
            if message is None or is_marked(message.headers()):
                self._answer(state, request, Decision(UNKNOWN_MESSAGE_OUTCOME, message="no such message in the log"))
                continue
            publish_ms = max(message.timestamp()[1], 0)
            fate = judge(item.rule, message.headers(), publish_ms)
            if fate.rejected is not None:
                refused = Decision(
                    REJECTED,
                    code=DEAD_LETTERED,
                    message=f"the message went to the dead-letter topic ({fate.rejected.code})",
                )
                self._answer(state, request, refused)
                continue
            self._answer(state, request, decision, fate.deliver_at if fate.deliver_at is not None else publish_ms)

    # ------------------------------------------------------------------ facts

    def _fact_read(
        self, state: PartitionState, offset: int, raw: bytes | None, live: bool, through: int | None = None
    ) -> None:
        fact = Fact.decode(raw)
        if fact is None:
            logger.error("unreadable cancel or reschedule fact skipped partition=%s offset=%d", state.name, offset)
            return
        keyed = state.keyed
        if keyed is not None and fact.key is not None and fact.deliver_at is not None:
            keyed.moved(fact.key, fact.origin, fact.deliver_at)  # where the fact is, live and rebuilt alike
        if live and fact.request in state.unread_facts:
            state.unread_facts.discard(fact.request)
            return  # ours: taken into the overrides when it was decided
        if live and state.hold_until is not None:
            state.decided_earlier.add(fact.request)  # an earlier owner's: its request is not decided again
        pending = False
        copy, at = fact.copy, fact.deliver_at
        replaced = keyed is not None and fact.origin in keyed.replaced  # then its copy is not pending either
        if copy is not None and at is not None and (through is None or pack(at, copy) > through) and not replaced:
            # Nothing goes out before every fact is read (state.hold_until, or a rebuild).
            pending = state.tracker.add(copy, at, deliver_now=False)
        state.overrides.apply(fact, state.indexed, copy_pending=pending)
