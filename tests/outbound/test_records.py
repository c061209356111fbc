import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.outbound.records import Delivered, dead_letter_headers, outbound_headers, read_delivery


def test_the_compact_form_is_two_headers_after_the_original_ones_and_the_count_only_above_0() -> None:
    assert outbound_headers([("a", b"1"), ("b", None)], "orders", 2, 41, 1234) == [
        ("a", b"1"),
        ("b", b""),
        ("delay-origin", b"orders/2/41"),
        ("delay-deliver-at", b"1234"),
    ]
    assert outbound_headers(None, "orders", 2, 41, 1234, redelivery_count=3) == [
        ("delay-origin", b"orders/2/41"),
        ("delay-deliver-at", b"1234"),
        ("delay-redelivery-count", b"3"),
    ]


TOPICS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-", min_size=1, max_size=249)


@given(TOPICS, st.integers(0, 10_000), st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1), st.integers(0, 2**31),
       st.sampled_from(["compact", "v1"]))  # fmt: skip
def test_both_forms_read_back_the_same(topic: str, partition: int, offset: int, at: int, count: int, form: str) -> None:
    headers = dict(outbound_headers([("x", b"y")], topic, partition, offset, at, count, form))  # type: ignore[arg-type]
    assert read_delivery(headers) == Delivered(topic, partition, offset, at, count)


@pytest.mark.parametrize(
    "headers",
    [{}, {"delay-origin": b"orders/1"}, {"delay-origin": b"orders/x/1", "delay-deliver-at": b"5"},
     {"delay-origin": b"orders/1/2"}, {"delay-origin-topic": b"t", "delay-deliver-at": b"5"}],
)  # fmt: skip
def test_a_record_without_a_whole_origin_is_refused_with_the_names(headers: dict[str, bytes]) -> None:
    with pytest.raises(ValueError, match="'delay-origin'"):
        read_delivery(headers)


def test_the_v1_form_keeps_the_original_and_adds_the_message_id() -> None:
    headers = outbound_headers([("a", b"1"), ("b", None)], "orders", 2, 41, 1234, redelivery_count=3, form="v1")
    assert headers == [
        ("a", b"1"),
        ("b", b""),
        ("delay-origin-topic", b"orders"),
        ("delay-origin-partition", b"2"),
        ("delay-origin-offset", b"41"),
        ("delay-deliver-at", b"1234"),
        ("delay-redelivery-count", b"3"),
    ]


def test_dead_letter_headers_carry_code_message_and_origin() -> None:
    headers = dict(dead_letter_headers(None, "orders", 0, 7, "INVALID_DELAY_HEADER", "bad"))
    assert headers == {
        "delay-error-code": b"INVALID_DELAY_HEADER",
        "delay-error-message": b"bad",
        "delay-origin-topic": b"orders",
        "delay-origin-partition": b"0",
        "delay-origin-offset": b"7",
    }
