"""Nack command parsing (contract section 5): every shape, and hypothesis for anything else."""

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.control import commands
from sidecar.control.commands import (
    AcceptedNack,
    NackCommand,
    _parse,
    accepted_key,
    check_max_delay,
    parse_accepted,
    parse_accepted_record,
    parse_command,
)
from sidecar.durations import MAX_EPOCH_MS
from sidecar.errors import RejectedRecord
from sidecar.policy.model import EffectiveDelay, Sourced


def command(**fields: Any) -> bytes:
    base: dict[str, Any] = {"v": 1, "type": "nack", "subscription": "billing", "topic": "payments.orders",
                            "partition": 3, "offset": 1234, "delay_ms": 30000}  # fmt: skip
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def delay(max_ms: int, enabled: bool = True) -> EffectiveDelay:
    return EffectiveDelay(Sourced(enabled, "topic"), Sourced(max_ms, "namespace:x"), Sourced(0, "defaults"))


def test_the_contract_example_parses() -> None:
    parsed = parse_command(command())
    assert parsed == NackCommand("billing", "payments.orders", 3, 1234, 30000, None, 0)
    assert parsed.effective_deliver_at(1_000) == 31_000
    assert parsed.message_key == ("billing", "payments.orders", 3, 1234)


def test_deliver_at_and_redelivery_count() -> None:
    parsed = parse_command(command(delay_ms=..., deliver_at=5_000, redelivery_count=2))
    assert (parsed.deliver_at, parsed.delay_ms, parsed.redelivery_count) == (5_000, None, 2)
    assert parsed.effective_deliver_at(1_000) == 5_000


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (None, "no value"),
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (command(v=2), "unsupported version"),
        (command(v=...), "unsupported version"),
        (command(type="ack"), "unknown command type"),
        (command(subscription=""), "'subscription' must be"),
        (command(topic=7), "'topic' must be"),
        (command(topic="t" * 300), "longer than any Kafka topic"),
        (command(partition=-1), "'partition' must be"),
        (command(offset="12"), "'offset' must be"),
        (command(offset=True), "'offset' must be"),
        (command(delay_ms=-5), "'delay_ms' must be"),
        (command(delay_ms=1.5), "'delay_ms' must be"),
        (command(delay_ms=...), "exactly one"),
        (command(deliver_at=10), "exactly one"),
        (command(delay_ms=10**18), "past year 9999"),
        (command(redelivery_count=-1), "'redelivery_count' must be"),
    ],
)
def test_malformed_commands_are_invalid_command(raw: bytes | None, message: str) -> None:
    with pytest.raises(RejectedRecord, match=message) as caught:
        parse_command(raw)
    assert caught.value.code == "INVALID_COMMAND"


def test_max_delay_applies_to_nacks() -> None:
    parsed = parse_command(command(delay_ms=90_000))
    check_max_delay(parsed, delay(0), 0)
    check_max_delay(parsed, delay(60_000, enabled=False), 0)
    check_max_delay(parsed, delay(90_000), 0)
    with pytest.raises(RejectedRecord, match="by 30s") as caught:
        check_max_delay(parsed, delay(60_000), 0)
    assert caught.value.code == "EXCEEDS_MAX_DELAY"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=10,
)


@given(st.binary())
def test_any_bytes_give_a_command_or_invalid_command(raw: bytes) -> None:
    try:
        parse_command(raw)
    except RejectedRecord as e:
        assert e.code == "INVALID_COMMAND"


@given(st.dictionaries(st.sampled_from(["v", "type", "subscription", "topic", "partition", "offset", "delay_ms",
                                        "deliver_at", "redelivery_count", "x"]), json_values))  # fmt: skip
def test_any_json_object_gives_a_command_or_invalid_command(data: dict[str, Any]) -> None:
    try:
        parse_command(json.dumps(data).encode())
    except RejectedRecord as e:
        assert e.code == "INVALID_COMMAND"


def outcome(parse: Callable[[bytes], object], raw: bytes) -> object:
    try:
        return parse(raw)
    except RejectedRecord as e:
        return e.code, e.message


NACK_FIELDS = ("v", "type", "subscription", "topic", "partition", "offset", "delay_ms", "deliver_at",
               "redelivery_count")  # fmt: skip
_NUMBERS = [-1, 0, 1.0, True, None, "1", MAX_EPOCH_MS, MAX_EPOCH_MS + 1, 2**70]
# Each field with the values either path may judge differently, so that every check is met
# alone often enough; and any field with any JSON value.
_EDGES = (
    [("v", v) for v in (1.0, True, 2, "1", None)]
    + [("type", v) for v in ("cancel", "accepted", "NACK", None)]
    + [(f, v) for f in ("subscription", "topic") for v in ("", "t" * 249, "t" * 250, 5, None)]
    + [(f, v) for f in NACK_FIELDS[4:] for v in _NUMBERS]
)
nack_changes = st.one_of(st.sampled_from(_EDGES), st.tuples(st.sampled_from(NACK_FIELDS), json_values))


def fast_and_long(changed: list[tuple[str, Any]], removed: set[str], duplicate: bool = False) -> tuple[object, object]:
    data: dict[str, Any] = {"v": 1, "type": "nack", "subscription": "s", "topic": "t", "partition": 0, "offset": 3,
                            "delay_ms": 5, "redelivery_count": 1}  # fmt: skip
    data.update(changed)
    for name in removed:
        data.pop(name, None)
    raw = json.dumps(data)
    if duplicate and data:  # a key given twice: the last one counts, as json.loads has it
        raw = raw[:-1] + ", " + json.dumps({"partition": 7})[1:]
    return outcome(parse_command, raw.encode()), outcome(_parse, raw.encode())


@pytest.mark.parametrize("removed", [set(), {"delay_ms"}])
@pytest.mark.parametrize(("field", "value"), _EDGES)
def test_each_edge_of_a_nack_field_is_judged_alike_by_the_fast_and_the_long_decoding(
    field: str, value: Any, removed: set[str]
) -> None:
    fast, long = fast_and_long([(field, value)], removed)
    assert fast == long


@settings(max_examples=300)
@given(st.lists(nack_changes, max_size=2), st.sets(st.sampled_from(NACK_FIELDS), max_size=2), st.booleans())
def test_the_fast_decoding_of_a_nack_agrees_with_the_long_one(
    changed: list[tuple[str, Any]], removed: set[str], duplicate: bool
) -> None:
    """parse_command takes well-formed nacks in one C pass (msgspec); whatever it is given, it returns
    or refuses exactly what the field-by-field parse does: a valid nack with fields changed or removed."""
    fast, long = fast_and_long(changed, removed, duplicate)
    assert fast == long


def test_a_well_formed_nack_takes_the_fast_path_and_null_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The differential test above means something only if the fast path answers for real nacks."""
    calls: list[bytes | None] = []
    monkeypatch.setattr(commands, "_parse", calls.append)
    good = b'{"v":1,"type":"nack","subscription":"s","topic":"t","partition":0,"offset":3,"delay_ms":5}'
    assert parse_command(good) == NackCommand("s", "t", 0, 3, 5, None, 0)
    assert calls == []
    parse_command(good.replace(b'"delay_ms":5', b'"delay_ms":5,"deliver_at":null'))
    assert len(calls) == 1


def test_an_accepted_record_round_trips_and_is_not_a_command() -> None:
    command = parse_command(
        b'{"v":1,"type":"nack","subscription":"s","topic":"t","partition":1,"offset":2,"delay_ms":5}'
    )
    accepted = AcceptedNack(command, 1_700_000_000_005, ("orders.control", 2, 40))
    parsed = parse_accepted(accepted.encode(), "orders.control")
    assert (
        parsed is not None and parsed.deliver_at == accepted.deliver_at and parsed.source == ("orders.control", 2, 40)
    )
    assert parsed.command.message_key == command.message_key
    assert parse_accepted(b'{"v":1,"type":"nack"}', "c") is None and parse_accepted(b"\xff", "c") is None
    with pytest.raises(RejectedRecord, match="written by the sidecar"):
        parse_command(accepted.encode())


@given(
    st.text(min_size=1, max_size=20),
    st.text(min_size=1, max_size=20),
    st.integers(0, 2**40),
    st.integers(0, 2**40),
    st.booleans(),
)
def test_an_accepted_record_is_the_json_its_fields_say_whatever_the_names(
    subscription: str, topic: str, offset: int, deliver_at: int, cancelled: bool
) -> None:
    command = NackCommand(subscription, topic, 3, offset, None, deliver_at, 2)
    accepted = AcceptedNack(command, deliver_at, ("ctl", 1, offset + 1), cancelled)
    expected = {"v": 1, "type": "accepted", "subscription": subscription, "topic": topic, "partition": 3,
                "offset": offset, "deliver_at": deliver_at, "redelivery_count": 2, "command_partition": 1,
                "command_offset": offset + 1}  # fmt: skip
    assert json.loads(accepted.encode()) == expected | ({"cancelled": True} if cancelled else {})
    assert parse_accepted(accepted.encode(), "ctl") == accepted
    assert accepted_key(accepted.encode()) == offset + 1


@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=12), st.text(min_size=1, max_size=12), st.integers(0, 2**40)),
        min_size=1,
        max_size=8,
    ),
    st.integers(-1, 8),
)
def test_an_accepted_record_holds_a_slice_of_acceptances_a_line_each(
    fields: list[tuple[str, str, int]], spoiled: int
) -> None:
    """A slice of commands writes one accepted record per control partition; any name, newlines
    included, stays on its line (JSON escapes it), and one line that is not an acceptance makes
    the record none (a command with the sidecar's header, dead-lettered for an operator to see)."""
    lines = [
        AcceptedNack(NackCommand(sub, topic, 0, offset, None, offset + 5, 0), offset + 5, ("ctl", 2, 100 + i))
        for i, (sub, topic, offset) in enumerate(fields)
    ]
    encoded = [line.encode() for line in lines]
    assert parse_accepted_record(b"\n".join(encoded), "ctl") == lines
    assert accepted_key(b"\n".join(encoded)) == 100
    if 0 <= spoiled < len(encoded):
        encoded[spoiled] = b'{"v":1,"type":"nack"}'
        assert parse_accepted_record(b"\n".join(encoded), "ctl") is None
