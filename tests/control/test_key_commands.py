"""Cancels and reschedules that name their message by key (contract section 5). Pure."""

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.client_cancel import ByKey
from sidecar.control.cancels import (
    MAX_KEY_BYTES,
    OutcomeRecord,
    Request,
    parse_message_command,
)
from sidecar.errors import RejectedRecord

BASE = {"type": "cancel", "topic": "orders"}


def test_a_key_names_the_message_instead_of_partition_and_offset() -> None:
    command = parse_message_command({**BASE, "key": "user-7"})
    assert (command.key, command.partition, command.offset) == (b"user-7", -1, -1)
    assert (command.ref.partition, command.ref.offset, command.ref.key) == (None, None, b"user-7")
    binary = parse_message_command({**BASE, "key_base64": base64.b64encode(b"\xff\x00").decode()})
    assert binary.key == b"\xff\x00"
    assert parse_message_command({**BASE, "partition": 1, "offset": 2}).key is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"key": "a", "key_base64": "YQ=="}, "give 'key' or 'key_base64', not both"),
        ({"key": "a", "partition": 0}, "name the message by 'key' or by 'partition' and 'offset', not both"),
        ({"key": ""}, "'key' must be a non-empty string"),
        ({"key_base64": "not base64!"}, "'key_base64' is not base64 (RFC 4648, with padding)"),
        ({"key_base64": 5}, "'key_base64' must be a non-empty string"),
        ({"key": "k" * (MAX_KEY_BYTES + 1)}, f"the key is longer than {MAX_KEY_BYTES} bytes"),
        ({}, "'partition' must be an integer of zero or more, got None"),
    ],
)
def test_a_malformed_key_is_refused_with_a_reason(fields: dict[str, object], message: str) -> None:
    with pytest.raises(RejectedRecord) as caught:
        parse_message_command({**BASE, **fields})
    assert (caught.value.code, caught.value.message) == ("INVALID_COMMAND", message)


@given(st.binary(min_size=1, max_size=64), st.none() | st.integers(0, 100))
def test_a_request_by_key_travels_whole(key: bytes, relay: int | None) -> None:
    request = Request("cancel", -1, None, "id", None, ("ctl", 0, 5), b"k", by_key=key, relay=relay)
    assert Request.decode(request.encode(), "ctl") == request


@given(st.dictionaries(st.sampled_from(["key", "key_base64", "partition", "offset"]), st.from_type(object)))
def test_any_key_fields_give_a_command_or_a_reason(fields: dict[str, object]) -> None:
    try:
        parse_message_command({**BASE, **fields})
    except RejectedRecord as e:
        assert e.code == "INVALID_COMMAND" and e.message


def test_the_outcome_carries_the_key_as_text_or_base64() -> None:
    def encoded(key: bytes) -> dict[str, object]:
        return dict(
            json.loads(OutcomeRecord("cancelled", "cancel", "t", 1, 2, "i", ("c", 0, 0), message_key=key).encode())
        )

    assert encoded(b"user-7")["key"] == "user-7"
    assert encoded(b"\xff")["key_base64"] == "/w==" and "key" not in encoded(b"\xff")


@given(st.binary(min_size=1, max_size=64) | st.text(min_size=1, max_size=32))
def test_what_the_client_sends_by_key_the_sidecar_reads_as_that_key(key: bytes | str) -> None:
    command = parse_message_command({"type": "cancel", **ByKey("orders", key).fields()})
    assert command.key == (key.encode() if isinstance(key, str) else key) and command.topic == "orders"
