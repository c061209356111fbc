"""The overrides table and the cancel/reschedule parser: pure code, no broker."""

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.control.cancels import (
    CANCELLED,
    INVALID_COMMAND,
    RESCHEDULED,
    TOO_LATE,
    UNKNOWN_MESSAGE_OUTCOME,
    Fact,
    MessageCommand,
    OutcomeRecord,
    Request,
    loose_command,
    message_kind,
)
from sidecar.control.commands import parse_command
from sidecar.control.overrides import Overrides
from sidecar.errors import RejectedRecord

SUBS = ("billing", "fraud")


class Index:
    """The tracker as the table sees it: which offsets are still indexed."""

    def __init__(self, *offsets: int) -> None:
        self.offsets = set(offsets)

    def __call__(self, offset: int) -> bool:
        return offset in self.offsets

    def pop(self, offset: int) -> None:
        self.offsets.discard(offset)


def request(kind: str, offset: int, sub: str | None = None, at: int | None = None) -> Request:
    return Request(kind, offset, sub, None, at, ("control", 0, 0), None)  # type: ignore[arg-type]


def decide_apply(table: Overrides, index: Index, at: int, req: Request) -> str:
    decision = table.decide(at, req, SUBS, index)
    if decision.fact is not None:
        if decision.fact.copy is not None:
            index.offsets.add(at)
        table.apply(decision.fact, index)
    return decision.outcome


def test_cancel_all_takes_the_message_back_from_every_subscription() -> None:
    table, index = Overrides(), Index(5)
    assert decide_apply(table, index, 10, request("cancel", 5)) == CANCELLED
    index.pop(5)
    assert table.popped(5, SUBS, index) == ((), None)
    assert not table


def test_cancel_one_leaves_the_others() -> None:
    table, index = Overrides(), Index(5)
    assert decide_apply(table, index, 10, request("cancel", 5, "fraud")) == CANCELLED
    index.pop(5)
    assert table.popped(5, SUBS, index) == (("billing",), None)


def test_a_cancel_after_delivery_is_too_late_and_changes_nothing() -> None:
    table, index = Overrides(), Index()
    decision = table.decide(10, request("cancel", 5), SUBS, index)
    assert decision.outcome == TOO_LATE and decision.fact is None and decision.too_late == SUBS


def test_a_second_cancel_is_answered_cancelled_again() -> None:
    table, index = Overrides(), Index(5)
    decide_apply(table, index, 10, request("cancel", 5))
    decision = table.decide(11, request("cancel", 5), SUBS, index)
    assert decision.outcome == CANCELLED and decision.fact is None


def test_a_subscription_the_message_was_not_owed_to_is_unknown() -> None:
    table, index = Overrides(), Index(5)
    assert table.decide(10, request("cancel", 5, "audit"), SUBS, index).outcome == UNKNOWN_MESSAGE_OUTCOME


def test_a_reschedule_moves_delivery_to_its_copy_and_a_cancel_then_reaches_the_copy() -> None:
    table, index = Overrides(), Index(5)
    assert decide_apply(table, index, 10, request("reschedule", 5, at=1_000)) == RESCHEDULED
    index.pop(5)
    assert table.popped(5, SUBS, index) == ((), None), "the original no longer goes out"
    assert decide_apply(table, index, 11, request("cancel", 5, "fraud")) == CANCELLED
    index.pop(10)
    subs, copy = table.popped(10, SUBS, index)
    assert subs == ("billing",) and copy is not None and copy.origin == 5 and copy.deliver_at == 1_000
    assert table.decide(12, request("cancel", 5), SUBS, index).outcome == TOO_LATE
    assert not table


def test_the_latest_reschedule_wins() -> None:
    table, index = Overrides(), Index(5)
    decide_apply(table, index, 10, request("reschedule", 5, at=1_000))
    decide_apply(table, index, 11, request("reschedule", 5, at=2_000))
    index.pop(10)
    assert table.popped(10, SUBS, index)[0] == (), "superseded copy"
    index.pop(5)
    table.popped(5, SUBS, index)
    index.pop(11)
    subs, copy = table.popped(11, SUBS, index)
    assert subs == SUBS and copy is not None and copy.deliver_at == 2_000


def test_a_rebuild_applying_the_facts_again_gets_the_same_table() -> None:
    """Facts replayed in log order against the index as the commit left it: the same deliveries."""
    table, index = Overrides(), Index(5, 6)
    facts: list[Fact] = []
    for at, req in ((10, request("reschedule", 5, at=1_000)), (11, request("cancel", 6, "billing")),
                    (12, request("cancel", 5, "fraud"))):  # fmt: skip
        decision = table.decide(at, req, SUBS, index)
        assert decision.fact is not None
        facts.append(decision.fact)
        if decision.fact.copy is not None:
            index.offsets.add(at)
        table.apply(decision.fact, index)
    again = Overrides()
    for fact in facts:
        decoded = Fact.decode(fact.encode())  # the rebuild reads the fact's record, not the object
        assert decoded is not None and decoded == fact, (decoded, fact)
        again.apply(decoded, index)
    for offset in (5, 6, 10):
        index.pop(offset)
        assert again.popped(offset, SUBS, index) == table.popped(offset, SUBS, index)


def test_a_fact_whose_carrier_went_out_before_the_commit_changes_nothing() -> None:
    table = Overrides()
    table.apply(Fact(5, 10, ((5, "billing"),)), Index())
    assert not table


@given(st.dictionaries(st.sampled_from(["v", "type", "topic", "partition", "offset", "subscription", "id",
                                         "deliver_at", "delay_ms"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-5, 10**20), st.text(max_size=5),
                                 st.lists(st.integers(), max_size=2))))  # fmt: skip
def test_any_cancel_or_reschedule_json_parses_or_is_refused_with_a_code(fields: dict[str, Any]) -> None:
    raw = json.dumps({**fields, "v": 1, "type": fields.get("type") or "cancel"}).encode()
    try:
        command = parse_command(raw)
    except RejectedRecord as rejected:
        assert rejected.code == INVALID_COMMAND and rejected.message
        ref = loose_command(raw)
        OutcomeRecord("rejected", ref.kind, ref.topic, ref.partition, ref.offset, ref.id, ("control", 0, 0)).encode()
        return
    if isinstance(command, MessageCommand):
        assert message_kind(raw) == command.kind
        assert command.offset >= 0 and command.partition >= 0


@pytest.mark.parametrize(
    "body",
    [
        {"type": "cancel"},
        {"type": "cancel", "topic": "t", "partition": 0},
        {"type": "cancel", "topic": "", "partition": 0, "offset": 1},
        {"type": "cancel", "topic": "t", "partition": -1, "offset": 1},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": -1},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": 1.5},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": True},
        {"type": "cancel", "topic": "t", "partition": "0", "offset": 1},
        {"type": "cancel", "topic": "t" * 250, "partition": 0, "offset": 1},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": 1, "subscription": ""},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": 1, "subscription": 3},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": 1, "id": 7},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": 1, "id": "x" * 300},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": 1, "delay_ms": 5},
        {"type": "cancel", "topic": "t", "partition": 0, "offset": 1, "deliver_at": 5},
        {"type": "reschedule", "topic": "t", "partition": 0, "offset": 1},
        {"type": "reschedule", "topic": "t", "partition": 0, "offset": 1, "delay_ms": 5, "deliver_at": 5},
        {"type": "reschedule", "topic": "t", "partition": 0, "offset": 1, "delay_ms": -5},
        {"type": "reschedule", "topic": "t", "partition": 0, "offset": 1, "delay_ms": "5s"},
        {"type": "reschedule", "topic": "t", "partition": 0, "offset": 1, "deliver_at": 10**18},
        {"type": "reschedule", "topic": "t", "partition": 0, "offset": 1, "deliver_at": None},
        {"type": "reschedule", "topic": None, "partition": 0, "offset": 1, "delay_ms": 5},
        {"type": "reschedule", "topic": ["t"], "partition": 0, "offset": 1, "delay_ms": 5},
        {"type": "reschedule", "partition": 0, "offset": 1, "delay_ms": 5},
        {"type": "reschedule", "topic": "t", "partition": 0, "offset": {}, "delay_ms": 5},
    ],
)
def test_25_malformed_commands_are_refused_with_invalid_command(body: dict[str, Any]) -> None:
    raw = json.dumps({"v": 1, **body}).encode()
    with pytest.raises(RejectedRecord) as refused:
        parse_command(raw)
    assert refused.value.code == INVALID_COMMAND
    assert message_kind(raw) == body["type"], "answered on the outcomes topic, not dead-lettered"


def test_a_request_round_trips_with_and_without_cancelled_nacks_and_reads_the_older_form() -> None:
    plain = Request("cancel", 7, None, "c1", None, ("payments.control", 2, 40), b"t/0/7")
    with_nacks = Request("cancel", 7, "billing", None, None, ("payments.control", 2, 41), None, ("billing",))
    for request in (plain, with_nacks):
        assert Request.decode(request.encode(), "default") == request
    assert b"nacks" not in plain.encode()
    older = b'{"kind":"cancel","offset":7,"subscription":null,"id":null,"deliver_at":null,"source":[2,40],"key":null}'
    assert Request.decode(older, "default") == Request("cancel", 7, None, None, None, ("default", 2, 40), None)
