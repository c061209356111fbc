"""decide() under every combination of policy, level and header, with the YAML loaded for real."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.errors import RejectedRecord
from sidecar.policy import Decision, decide, load_policies
from sidecar.policy.model import EffectiveDelay, Sourced

WriteYaml = Callable[..., Path]

PUBLISH = 1_700_000_000_000
MINUTE = 60_000
FIXED = "30m"
MAX = "1h"
TOPIC = "payments.orders"

HEADERS: dict[str, list[tuple[str, bytes | None]] | None] = {
    "absent": None,
    "valid": [("deliver-after", b"1m")],
    "invalid": [("deliver-after", b"soon")],
    "over": [("deliver-after", b"2h")],
}
REQUESTED = {"valid": PUBLISH + MINUTE, "over": PUBLISH + 120 * MINUTE}

# Where the policy is set. The "-zeroed-by-" levels set it at the parent and an explicit 0 below:
# the explicit 0 must win (it disables at that level, it does not inherit).
LEVELS = ["topic", "namespace", "defaults", "namespace-zeroed-by-topic", "defaults-zeroed-by-namespace"]
KINDS = {"fixed": ["fixed"], "max": ["max"], "both": ["fixed", "max"], "neither": []}


def policy_yaml(kind: str, level: str) -> dict[str, Any]:
    values = {
        {"fixed": "fixed_delivery_delay", "max": "max_delivery_delay"}[k]: {"fixed": FIXED, "max": MAX}[k]
        for k in KINDS[kind]
    }
    zeros = {name: 0 for name in values}
    at: dict[str, dict[str, Any]] = {"topic": {}, "namespace": {}, "defaults": {}}
    if level in ("topic", "namespace", "defaults"):
        at[level] = values
    elif level == "namespace-zeroed-by-topic":
        at["namespace"], at["topic"] = values, zeros
    else:
        at["defaults"], at["namespace"] = values, zeros
    return {
        "defaults": {"delayed_delivery": at["defaults"]},
        "namespaces": {"payments": {"topics": "payments.*", "delayed_delivery": at["namespace"]}},
        "topics": {TOPIC: {"delayed_delivery": at["topic"], "subscriptions": {"billing": {}}}},
    }


def expected(kind: str, level: str, header: str) -> Decision | str:
    zeroed = "zeroed" in level
    fixed = "fixed" in KINDS[kind] and not zeroed
    limited = "max" in KINDS[kind] and not zeroed
    if header == "invalid":
        return "INVALID_DELAY_HEADER"
    if fixed:
        return Decision(PUBLISH + 30 * MINUTE, overridden=header != "absent")
    if header == "absent":
        return Decision(None)
    if header == "over" and limited:
        return "EXCEEDS_MAX_DELAY"
    return Decision(REQUESTED[header])


CASES = [(k, lv, h) for k in KINDS for lv in LEVELS for h in HEADERS]


@pytest.mark.parametrize(("kind", "level", "header"), CASES, ids=["-".join(c) for c in CASES])
def test_policy_table(write_yaml: WriteYaml, kind: str, level: str, header: str) -> None:
    policies = load_policies(write_yaml("p.yaml", policy_yaml(kind, level)))
    delay = policies.topics[TOPIC].delay
    want = expected(kind, level, header)
    if isinstance(want, str):
        with pytest.raises(RejectedRecord) as caught:
            decide(delay, HEADERS[header], PUBLISH)
        assert caught.value.code == want
    else:
        assert decide(delay, HEADERS[header], PUBLISH) == want


@pytest.mark.parametrize(
    ("defaults", "namespace", "topic", "enabled"),
    [
        (False, None, None, False),
        (None, False, None, False),
        (None, None, False, False),
        (False, True, None, True),
        (False, None, True, True),
        (None, False, True, True),
        (True, None, False, False),
    ],
)
def test_enabled_inherits_and_overrides(
    write_yaml: WriteYaml, defaults: bool | None, namespace: bool | None, topic: bool | None, enabled: bool
) -> None:
    def level(value: bool | None) -> dict[str, Any]:
        return {"delayed_delivery": {} if value is None else {"enabled": value}}

    data = {
        "defaults": level(defaults),
        "namespaces": {"payments": {"topics": "payments.*", **level(namespace)}},
        "topics": {TOPIC: {**level(topic), "delayed_delivery": {"fixed_delivery_delay": "5m"}}},
    }
    data["topics"][TOPIC]["delayed_delivery"].update(level(topic)["delayed_delivery"])
    delay = load_policies(write_yaml("p.yaml", data)).topics[TOPIC].delay
    assert delay.is_enabled is enabled
    for header in ("absent", "valid", "over"):
        got = decide(delay, HEADERS[header], PUBLISH)
        if enabled:
            assert got == Decision(PUBLISH + 5 * MINUTE, overridden=header != "absent")
        else:
            assert got == Decision(None, disabled=header != "absent")


def delay(enabled: bool = True, max_ms: int = 0, fixed_ms: int = 0, source: str = "topic") -> EffectiveDelay:
    return EffectiveDelay(Sourced(enabled, source), Sourced(max_ms, source), Sourced(fixed_ms, source))


def test_disabled_topic_still_rejects_an_invalid_header() -> None:
    with pytest.raises(RejectedRecord) as caught:
        decide(delay(enabled=False), [("deliver-at", b"tomorrow")], PUBLISH)
    assert caught.value.code == "INVALID_DELAY_HEADER"


def test_max_message_says_limit_source_and_excess() -> None:
    with pytest.raises(RejectedRecord) as caught:
        decide(delay(max_ms=3_600_000, source="namespace:payments"), [("deliver-after", b"90m")], PUBLISH)
    assert caught.value.code == "EXCEEDS_MAX_DELAY"
    assert caught.value.message == ("delay of 90m exceeds the max delivery delay 1h (from namespace:payments) by 30m")


def test_a_delay_equal_to_max_is_accepted() -> None:
    assert decide(delay(max_ms=3_600_000), [("deliver-after", b"1h")], PUBLISH) == Decision(PUBLISH + 3_600_000)


def test_a_deliver_at_in_the_past_is_not_limited() -> None:
    past = str(PUBLISH - 10 * 86_400_000).encode()
    assert decide(delay(max_ms=1), [("deliver-at", past)], PUBLISH) == Decision(None)


@pytest.mark.parametrize("value", [b"0", b"1000", str(PUBLISH - 1).encode(), str(PUBLISH).encode()])
def test_every_deliver_at_up_to_the_publish_time_means_at_once(value: bytes) -> None:
    """Issue 12: deliver-at 0 went out with delay-deliver-at = publish time, deliver-at 1000 with 1000."""
    assert decide(delay(), [("deliver-at", value)], PUBLISH) == Decision(None)
    assert decide(delay(), [("deliver-after", b"0")], PUBLISH) == Decision(None)
    assert decide(delay(), [("deliver-at", str(PUBLISH + 1).encode())], PUBLISH) == Decision(PUBLISH + 1)


@pytest.mark.parametrize("name", ["Deliver-At", "DELIVER-AFTER", "deliver-At"])
def test_a_delay_header_in_other_letter_case_is_not_applied_but_flagged(name: str) -> None:
    assert decide(delay(), [(name, b"1h")], PUBLISH) == Decision(None, miscased=True)
    both = [(name, b"1h"), ("deliver-after", b"1m")]
    assert decide(delay(), both, PUBLISH) == Decision(PUBLISH + MINUTE, miscased=True)
    assert decide(delay(enabled=False), [(name, b"1h")], PUBLISH) == Decision(None, miscased=True)
    assert decide(delay(), [("deliver-atx", b"1h"), ("Deliver", b"1")], PUBLISH) == Decision(None)


@pytest.mark.parametrize(
    ("policy", "header", "retention_ms", "outcome"),
    [
        (delay(), [("deliver-after", b"2d")], 86_400_000, "EXCEEDS_RETENTION"),
        (delay(), [("deliver-after", b"1d")], 86_400_000, PUBLISH + 86_400_000),
        (delay(), [("deliver-after", b"30d")], -1, PUBLISH + 30 * 86_400_000),
        (delay(), [("deliver-after", b"30d")], None, PUBLISH + 30 * 86_400_000),
        (delay(fixed_ms=2 * 86_400_000), None, 86_400_000, "EXCEEDS_RETENTION"),
        (delay(enabled=False), [("deliver-after", b"30d")], 1, None),
        (delay(), None, 1, None),
    ],
)
def test_retention(
    policy: EffectiveDelay,
    header: list[tuple[str, bytes | None]] | None,
    retention_ms: int | None,
    outcome: int | str | None,
) -> None:
    if isinstance(outcome, str):
        with pytest.raises(RejectedRecord) as caught:
            decide(policy, header, PUBLISH, retention_ms)
        assert caught.value.code == outcome
    else:
        assert decide(policy, header, PUBLISH, retention_ms).deliver_at == outcome


def test_retention_message() -> None:
    with pytest.raises(RejectedRecord) as caught:
        decide(delay(), [("deliver-after", b"2d")], PUBLISH, 86_400_000)
    assert caught.value.message == (
        "deliver-at is 2d after publish, but the inbound topic keeps records for retention.ms=86400000 (1d); "
        "the record would be deleted before delivery"
    )


def test_example_policies_load() -> None:
    policies = load_policies(Path(__file__).parents[2] / "policies" / "example.yaml")
    audit = policies.topics["payments.refunds"].subscription("audit")
    assert audit is not None and audit.ordered
    assert policies.topics["payments.refunds"].delay.max_delivery_delay == Sourced(86_400_000, "namespace:payments")
