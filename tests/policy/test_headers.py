"""Every header form of contract section 1, valid and invalid."""

import pytest

from sidecar.errors import InvalidDelayHeader
from sidecar.policy.headers import requested_deliver_at

PUBLISH = 1_795_000_000_000


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, None),
        ([], None),
        ([("other", b"x")], None),
        ([("deliver-at", b"1795000005000")], 1_795_000_005_000),
        ([("deliver-at", b"0")], 0),  # in the past: the caller delivers at once
        ([("deliver-at", b"2026-11-21T10:00:00Z")], 1_795_255_200_000),
        ([("deliver-at", b"2026-11-21T10:00:00z")], 1_795_255_200_000),
        ([("deliver-at", b"2026-11-21T12:00:00+02:00")], 1_795_255_200_000),
        ([("deliver-at", b"2026-11-21T05:00:00-05:00")], 1_795_255_200_000),
        ([("deliver-at", b"2026-11-21T10:00:00.123Z")], 1_795_255_200_123),
        ([("deliver-at", b"2026-11-21T10:00:00.5Z")], 1_795_255_200_500),
        ([("deliver-at", b"2026-11-21T10:00:00.123456789Z")], 1_795_255_200_123),
        ([("deliver-after", b"1500")], PUBLISH + 1500),
        ([("deliver-after", b"0")], PUBLISH),
        ([("deliver-after", b"250ms")], PUBLISH + 250),
        ([("deliver-after", b"30s")], PUBLISH + 30_000),
        ([("deliver-after", b"5m")], PUBLISH + 300_000),
        ([("deliver-after", b"2h")], PUBLISH + 7_200_000),
        ([("deliver-after", b"7d")], PUBLISH + 604_800_000),
        ([("x", b"1"), ("deliver-after", b"1s"), ("y", None)], PUBLISH + 1000),
    ],
)
def test_valid_forms(headers: list[tuple[str, bytes | None]] | None, expected: int | None) -> None:
    assert requested_deliver_at(headers, PUBLISH) == expected


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ([("deliver-at", b"soon")], "neither epoch milliseconds nor RFC 3339"),
        ([("deliver-at", b"-5")], "negative"),
        ([("deliver-after", b"-1s")], "negative"),
        ([("deliver-after", b"1.5s")], "is not a duration"),
        ([("deliver-after", b"1w")], "is not a duration"),
        ([("deliver-after", b"1h30m")], "is not a duration"),
        ([("deliver-after", b" 1s")], "is not a duration"),
        ([("deliver-after", b"")], "is not a duration"),
        ([("deliver-after", b"10S")], "is not a duration"),
        ([("deliver-at", b"2026-11-21T10:00:00")], "RFC 3339 with an offset"),
        ([("deliver-at", b"2026-11-21")], "RFC 3339"),
        ([("deliver-at", b"2026-13-45T10:00:00Z")], "not a real date"),
        ([("deliver-at", b"2026-02-30T10:00:00Z")], "not a real date"),
        ([("deliver-at", b"99999999999999999")], "after year 9999"),
        ([("deliver-after", b"999999999999999999d")], "after year 9999"),
        ([("deliver-at", None)], "has no value"),
        ([("deliver-at", "\u00e9t\u00e9".encode())], "not ASCII"),
        ([("deliver-at", b"1"), ("deliver-at", b"2")], "appears more than once"),
        ([("deliver-after", b"1s"), ("deliver-after", b"1s")], "appears more than once"),
        ([("deliver-at", b"1"), ("deliver-after", b"1s")], "both 'deliver-at' and 'deliver-after'"),
    ],
)
def test_invalid_forms(headers: list[tuple[str, bytes | None]], message: str) -> None:
    with pytest.raises(InvalidDelayHeader, match=message) as caught:
        requested_deliver_at(headers, PUBLISH)
    assert caught.value.code == "INVALID_DELAY_HEADER"
