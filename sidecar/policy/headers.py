"""The `deliver-at` / `deliver-after` headers of PIP-26, as Kafka headers (contract section 1).

Pure code: it sees header lists and timestamps, never a Kafka client, so every form can be tested.
"""

import re
from datetime import datetime
from typing import NamedTuple

from sidecar.durations import MAX_EPOCH_MS, format_duration_ms, parse_duration_ms
from sidecar.errors import InvalidDelayHeader

DELIVER_AT = "deliver-at"
DELIVER_AFTER = "deliver-after"

Headers = list[tuple[str, bytes | None]] | None

_EPOCH_MS = re.compile(r"[0-9]{1,18}")
_RFC3339 = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2})[Tt ]([0-9]{2}:[0-9]{2}:[0-9]{2})(?:\.([0-9]{1,9}))?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)


_NAME_LENGTHS = (len(DELIVER_AT), len(DELIVER_AFTER))


class DelayRequest(NamedTuple):
    deliver_at: int | None
    """What the delay header asks for in epoch ms; None without one."""
    miscased: str | None = None
    """A header named like a delay header in other letter case (`Deliver-At`), which is not one.

    Kafka header names are case-sensitive and so is the contract: such a header is ignored, and
    counted (delay_header_miscased_total) so a producer that spells it so can be found.
    """


def requested_deliver_at(headers: Headers, publish_ms: int) -> int | None:
    """The deliver-at a record asks for in epoch ms, or None when it carries no delay header.

    A deliver-at in the past is returned as it is: the caller delivers such a record at once.
    Raises InvalidDelayHeader for anything else the contract does not allow.
    """
    return delay_request(headers, publish_ms).deliver_at


def delay_request(headers: Headers, publish_ms: int) -> DelayRequest:
    """requested_deliver_at, and the name of a delay header in the wrong letter case if there is one."""
    if not headers:
        return DelayRequest(None)
    found: tuple[str, bytes | None] | None = None
    miscased: str | None = None
    for name, value in headers:
        if name in (DELIVER_AT, DELIVER_AFTER):
            if found is not None:
                if found[0] == name:
                    raise InvalidDelayHeader(f"header '{name}' appears more than once; send it once")
                raise InvalidDelayHeader("both 'deliver-at' and 'deliver-after' are set; send only one")
            found = (name, value)
        elif len(name) in _NAME_LENGTHS and name.lower() in (DELIVER_AT, DELIVER_AFTER):
            miscased = name
    if found is None:
        return DelayRequest(None, miscased)
    return DelayRequest(_deliver_at(found, publish_ms), miscased)


def _deliver_at(found: tuple[str, bytes | None], publish_ms: int) -> int:
    name, raw = found
    text = _ascii(name, raw)
    if text.startswith("-"):
        raise InvalidDelayHeader(f"'{name}: {text}' is negative; a delay must be zero or more")
    if name == DELIVER_AT:
        deliver_at = _parse_instant(text)
    else:
        delay = parse_duration_ms(text)
        if delay is None:
            raise InvalidDelayHeader(
                f"'deliver-after: {text}' is not a duration; use milliseconds or 250ms, 30s, 5m, 2h, 7d"
            )
        deliver_at = publish_ms + delay
    if deliver_at > MAX_EPOCH_MS:
        raise InvalidDelayHeader(
            f"'{name}: {text}' lies after year 9999; the largest delay is "
            f"{format_duration_ms(max(MAX_EPOCH_MS - publish_ms, 0))} from this record's timestamp"
        )
    return deliver_at


def _ascii(name: str, raw: bytes | None) -> str:
    if raw is None:
        raise InvalidDelayHeader(f"header '{name}' has no value")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidDelayHeader(f"header '{name}' is not ASCII text") from None


def _parse_instant(text: str) -> int:
    if _EPOCH_MS.fullmatch(text):
        return int(text)
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise InvalidDelayHeader(
            f"'deliver-at: {text}' is neither epoch milliseconds nor RFC 3339 with an offset "
            "(like 2026-11-21T10:00:00Z)"
        )
    date, clock, fraction, offset = match.groups()
    offset = "+00:00" if offset in ("Z", "z") else offset
    try:
        instant = datetime.fromisoformat(f"{date}T{clock}{offset}")
    except ValueError:
        raise InvalidDelayHeader(f"'deliver-at: {text}' is not a real date and time") from None
    millis = int((fraction or "0")[:3].ljust(3, "0"))
    return int(instant.timestamp()) * 1000 + millis
