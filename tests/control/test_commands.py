"""Nack command parsing (contract section 5): every shape, and hypothesis for anything else."""

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.control.commands import (
    AcceptedNack,
    NackCommand,
    accepted_key,
    check_max_delay,
    parse_accepted,
    parse_command,
)
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
