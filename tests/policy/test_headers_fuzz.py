"""The delay-header parser, fed any headers, returns a deliver-at or raises InvalidDelayHeader only."""

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.durations import MAX_EPOCH_MS
from sidecar.errors import InvalidDelayHeader
from sidecar.policy.headers import DELIVER_AFTER, DELIVER_AT, requested_deliver_at

NAMES = st.sampled_from([DELIVER_AT, DELIVER_AFTER, "Deliver-At", "deliver_at", "trace-id"]) | st.text(max_size=10)
VALUES = (
    st.none()
    | st.binary(max_size=40)
    | st.from_regex(r"-?[0-9]{1,20}(ms|s|m|h|d)?", fullmatch=True).map(str.encode)
    | st.from_regex(
        r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}"
        r"(\.[0-9]{1,9})?([Zz]|[+-][0-9]{2}:[0-9]{2})",
        fullmatch=True,
    ).map(str.encode)
)
HEADERS = st.none() | st.lists(st.tuples(NAMES, VALUES), max_size=4)
PUBLISH = st.integers(min_value=0, max_value=MAX_EPOCH_MS)


@settings(max_examples=1000, deadline=None)
@given(headers=HEADERS, publish_ms=PUBLISH)
def test_only_invalid_delay_header_is_raised(headers: list[tuple[str, bytes | None]] | None, publish_ms: int) -> None:
    try:
        deliver_at = requested_deliver_at(headers, publish_ms)
    except InvalidDelayHeader as e:
        assert e.code == "INVALID_DELAY_HEADER"
        assert e.message
        return
    if deliver_at is not None:
        assert deliver_at <= MAX_EPOCH_MS  # before 1970 is allowed: "in the past", delivered at once


@settings(max_examples=500, deadline=None)
@given(value=st.from_regex(r"[0-9]{1,18}(ms|s|m|h|d)?", fullmatch=True), publish_ms=PUBLISH)
def test_a_valid_deliver_after_is_relative_to_publish(value: str, publish_ms: int) -> None:
    try:
        deliver_at = requested_deliver_at([(DELIVER_AFTER, value.encode())], publish_ms)
    except InvalidDelayHeader:
        return  # only beyond year 9999
    assert deliver_at is not None and deliver_at >= publish_ms
