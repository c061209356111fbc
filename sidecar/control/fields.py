"""The fields of a control command's JSON object, checked: every type of command reads them alike. Pure."""

from typing import Any

from sidecar.durations import MAX_EPOCH_MS
from sidecar.errors import RejectedRecord

INVALID_COMMAND = "INVALID_COMMAND"


def invalid(message: str) -> RejectedRecord:
    return RejectedRecord(INVALID_COMMAND, message)


def text(data: dict[str, Any], field: str) -> str:
    value = data.get(field)
    if not isinstance(value, str) or not value:
        raise invalid(f"'{field}' must be a non-empty string")
    return value


def count(data: dict[str, Any], field: str) -> int:
    value = data.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"'{field}' must be an integer of zero or more, got {value!r}")
    return value


def when(data: dict[str, Any]) -> tuple[int | None, int | None]:
    """(delay_ms, deliver_at): exactly one of them, neither past year 9999."""
    has_delay, has_at = "delay_ms" in data, "deliver_at" in data
    if has_delay == has_at:
        raise invalid("give exactly one of 'delay_ms' and 'deliver_at'")
    delay_ms = count(data, "delay_ms") if has_delay else None
    deliver_at = count(data, "deliver_at") if has_at else None
    if (delay_ms or 0) > MAX_EPOCH_MS or (deliver_at or 0) > MAX_EPOCH_MS:
        raise invalid("the time reaches past year 9999")
    return delay_ms, deliver_at
