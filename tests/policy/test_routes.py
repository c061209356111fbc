"""Routes and intake rules: where a record goes now, and what it was owed when it arrived."""

from pathlib import Path

from sidecar.policy import load_policies
from sidecar.policy.routes import IntakeRule, Routes


def routes_of(tmp_path: Path, text: str) -> Routes:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return Routes.of(load_policies(path).topics["orders"])


def test_a_record_is_owed_to_the_subscriptions_that_honoured_delays_at_intake(tmp_path: Path) -> None:
    before = routes_of(tmp_path, "topics:\n  orders:\n    subscriptions: {a: {}, b: {}, c: {type: exclusive}}\n")
    rule = before.rule(None)
    assert rule.delayed == ("a", "b")
    # b became exclusive and a was removed: b still gets what it was owed, a nothing more.
    after = routes_of(tmp_path, "topics:\n  orders:\n    subscriptions: {b: {type: exclusive}, c: {}}\n")
    assert after.targets(rule) == [("b", "orders.b")]
    assert [name for name, _ in after.delayed] == ["c"] and [name for name, _ in after.ordered] == ["b"]


def test_rules_round_trip_and_compare_by_value(tmp_path: Path) -> None:
    routes = routes_of(
        tmp_path, "topics:\n  orders:\n    delayed_delivery: {max_delivery_delay: 1h}\n    subscriptions: {a: {}}\n"
    )
    rule = routes.rule(604_800_000)
    offset, decoded = IntakeRule.decode(rule.encode(17)) or (None, None)
    assert offset == 17 and decoded is not None and decoded.key == rule.key
    assert routes.rule(None).key != rule.key
    assert IntakeRule.decode([1, 2]) is None and IntakeRule.decode("x") is None


def test_a_keyed_rule_has_a_seventh_item_and_the_others_keep_six(tmp_path: Path) -> None:
    plain = routes_of(tmp_path, "topics:\n  orders:\n    subscriptions: {a: {}}\n").rule(None)
    keyed = routes_of(
        tmp_path, "topics:\n  orders:\n    delayed_delivery: {by_key: replace}\n    subscriptions: {a: {}}\n"
    ).rule(None)
    assert len(plain.encode(3)) == 6 and keyed.encode(3)[6:] == [1]
    assert plain.key != keyed.key
    for rule in (plain, keyed):
        offset, decoded = IntakeRule.decode(rule.encode(3)) or (None, None)
        assert offset == 3 and decoded is not None and decoded.key == rule.key and decoded.keyed == rule.keyed
    assert IntakeRule.decode([*keyed.encode(3)[:6], "x"]) is None
