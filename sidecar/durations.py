"""Durations as producers and operators write them: `1500`, `250ms`, `30s`, `5m`, `2h`, `7d`.

Shared by the delay headers and the policy YAML so both accept exactly the same forms.
"""

import re

_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"([0-9]{1,18})(ms|s|m|h|d)?")

# The latest instant we accept (9999-12-31T23:59:59.999Z): beyond it, no datetime or int64 consumer
# downstream (Spark, Java clients) can represent the value.
MAX_EPOCH_MS = 253_402_300_799_999


def parse_duration_ms(text: str) -> int | None:
    """Milliseconds for a duration string, or None when it is not one of the accepted forms."""
    match = _DURATION.fullmatch(text)
    if match is None:
        return None
    number, unit = match.groups()
    return int(number) * _UNIT_MS[unit or "ms"]


def format_duration_ms(ms: int) -> str:
    """The shortest exact form, for messages a person reads (`90000` -> `90s`)."""
    for unit in ("d", "h", "m", "s"):
        size = _UNIT_MS[unit]
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
