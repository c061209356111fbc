"""Loader errors, matched exactly: an operator reads them, so their wording is part of the interface."""

from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.errors import ConfigError
from sidecar.policy import PolicyError, Sourced, load_policies

WriteYaml = Callable[..., Path]


def problems(path: Path) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policies(path)
    assert isinstance(caught.value, ConfigError)
    return [str(p) for p in caught.value.problems]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "defaults:\n  delayed_delivery:\n    max_delivery_delay: 5 minutes\n",
            "3: defaults.delayed_delivery.max_delivery_delay: "
            "expected a duration (ms integer or 250ms, 30s, 5m, 2h, 7d), got '5 minutes'",
        ),
        (
            "defaults:\n  delayed_delivery:\n    fixed_delivery_delay: -5\n",
            "3: defaults.delayed_delivery.fixed_delivery_delay: "
            "expected a duration of zero or more (ms integer or 250ms, 30s, 5m, 2h, 7d), got -5",
        ),
        (
            "defaults:\n  delayed_delivery:\n    max_delivery_delay: true\n",
            "3: defaults.delayed_delivery.max_delivery_delay: "
            "expected a duration (ms integer or 250ms, 30s, 5m, 2h, 7d), got True",
        ),
        (
            "defaults:\n  delayed_delivery:\n    max_delivery_delay: 999999999999999999d\n",
            "3: defaults.delayed_delivery.max_delivery_delay: "
            "expected a duration of at most 253402300799999ms, got '999999999999999999d'",
        ),
        (
            "defaults:\n  delayed_delivery:\n    enabled: yes\n",
            "3: defaults.delayed_delivery.enabled: expected true or false, got 'yes'",
        ),
        (
            "namespaces:\n  pay:\n    topics: pay.*\n    delayed_delivery:\n      max_delay: 1d\n",
            "5: namespaces.pay.delayed_delivery.max_delay: "
            "unknown key; expected one of enabled, max_delivery_delay, fixed_delivery_delay, by_key",
        ),
        (
            "namespaces:\n  pay:\n    delayed_delivery: {}\n",
            '2: namespaces.pay.topics: required: a glob over topic names, like "payments.*"',
        ),
        (
            'namespaces:\n  pay:\n    topics: " "\n',
            '3: namespaces.pay.topics: expected a glob over topic names, like "payments.*", got an empty string',
        ),
        (
            "topics:\n  orders:\n    subscriptions:\n      billing:\n        type: round_robin\n",
            "5: topics.orders.subscriptions.billing.type: "
            "expected one of shared, key_shared, exclusive, failover, got 'round_robin'",
        ),
        (
            "topics:\n  orders:\n    dead_letter_topics: orders.dead\n",
            "3: topics.orders.dead_letter_topics: "
            "unknown key; expected one of delayed_delivery, dead_letter_topic, control_topic, subscriptions",
        ),
        (
            "topics:\n  orders:\n    subscriptions:\n      billing:\n        outbound: bad name!\n",
            "5: topics.orders.subscriptions.billing.outbound: expected a Kafka topic name "
            "(1 to 249 of a-z, A-Z, 0-9, '.', '_', '-'), got 'bad name!'",
        ),
        (
            "topics:\n  orders:\n    subscriptions: [billing]\n",
            "3: topics.orders.subscriptions: expected a mapping, got a list",
        ),
        (
            "topic:\n  orders: {}\n",
            "1: topic: unknown key; expected one of defaults, namespaces, topics, allow_empty",
        ),
        (
            "topics:\n  orders:\n    delayed_delivery: {by_key: latest}\n",
            "3: topics.orders.delayed_delivery.by_key: expected one of none, replace, got 'latest'",
        ),
        (
            "defaults:\n  enabled: false\n",
            "2: defaults.enabled: unknown key; expected one of delayed_delivery",
        ),
    ],
)
def test_exact_messages(write_yaml: WriteYaml, text: str, expected: str) -> None:
    path = write_yaml("p.yaml", text)
    assert problems(path) == [f"{path}:{expected}"]


def test_every_problem_is_reported_in_line_order(write_yaml: WriteYaml) -> None:
    path = write_yaml(
        "p.yaml",
        "topics:\n  a:\n    subscriptions:\n      s: {type: x}\n  b:\n    dead_letter_topic: 7\n",
    )
    assert problems(path) == [
        f"{path}:4: topics.a.subscriptions.s.type: expected one of shared, key_shared, exclusive, failover, got 'x'",
        f"{path}:6: topics.b.dead_letter_topic: expected a Kafka topic name, got 7",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- a\n- b\n", "expected a mapping with defaults, namespaces or topics at the top, got a list"),
        ("just text\n", "expected a mapping with defaults, namespaces or topics at the top, got 'just text'"),
    ],
)
def test_file_level_messages(write_yaml: WriteYaml, text: str, expected: str) -> None:
    path = write_yaml("p.yaml", text)
    assert problems(path) == [f"{path}: {expected}"]


def test_invalid_yaml_names_file_and_position(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", "topics:\n  a: [\n")
    (message,) = problems(path)
    assert message.startswith(f"{path}: not valid YAML: ")
    assert "line 3" in message


def test_duplicate_key_in_one_file(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", "topics:\n  a: {}\n  a: {}\n")
    (message,) = problems(path)
    assert message.startswith(f"{path}: not valid YAML: ")
    assert 'found duplicate key "a"' in message


def test_not_utf8(write_yaml: WriteYaml, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"topics:\n  \xff: {}\n")
    assert problems(path) == [f"{path}: expected UTF-8 text, got byte 0xff at offset 10"]


def test_missing_path(tmp_path: Path) -> None:
    assert problems(tmp_path / "nope.yaml") == [
        f"{tmp_path / 'nope.yaml'}: policy file not found; pass --policies FILE_OR_DIR"
    ]


def test_empty_directory(tmp_path: Path) -> None:
    assert problems(tmp_path) == [f"{tmp_path}: no .yaml or .yml files in this policies directory"]


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (
            "defaults:\n  delayed_delivery:\n    enabled: true\n",
            "defaults:\n  delayed_delivery:\n    enabled: false\n",
            "{b}:1: defaults: already defined in {a}; keep one defaults section",
        ),
        (
            "namespaces:\n  pay:\n    topics: pay.*\n",
            "# other team\nnamespaces:\n  pay:\n    topics: pay.*\n",
            "{b}:3: namespaces.pay: already defined in {a}; keep one",
        ),
        (
            "topics:\n  orders: {}\n",
            "topics:\n  x: {}\n  orders:\n    dead_letter_topic: o.dlt\n",
            "{b}:3: topics.orders: already defined in {a}; keep one",
        ),
    ],
)
def test_duplicates_across_files(write_yaml: WriteYaml, first: str, second: str, expected: str) -> None:
    a = write_yaml("policies/a.yaml", first)
    b = write_yaml("policies/b.yml", second)
    assert problems(a.parent) == [expected.format(a=a, b=b)]


def test_directory_merge(write_yaml: WriteYaml) -> None:
    write_yaml("policies/00-defaults.yaml", "defaults:\n  delayed_delivery:\n    max_delivery_delay: 7d\n")
    write_yaml("policies/10-payments.yaml", "namespaces:\n  payments:\n    topics: payments.*\n")
    write_yaml("policies/20-orders.yml", "topics:\n  payments.orders:\n    subscriptions:\n      billing: {}\n")
    write_yaml("policies/.#20-orders.yml", "topics:\n  payments.orders: {}\n")  # an editor's lock file
    write_yaml("policies/notes.txt", "not yaml at all: [")
    path = write_yaml("policies/20-orders.yml", "topics:\n  payments.orders:\n    subscriptions:\n      billing: {}\n")
    policies = load_policies(path.parent, generation=7)
    route = policies.topics["payments.orders"]
    assert policies.generation == 7
    assert route.namespace == "payments"
    assert route.delay.max_delivery_delay == Sourced(7 * 86_400_000, "defaults")
    assert [s.outbound for s in route.subscriptions] == ["payments.orders.billing"]
    assert len(policies.sources) == 3


def test_overlapping_namespace_globs(write_yaml: WriteYaml) -> None:
    path = write_yaml(
        "p.yaml",
        "namespaces:\n  payments:\n    topics: payments.*\n  orders:\n    topics: '*.orders'\n"
        "topics:\n  payments.orders: {}\n  payments.refunds: {}\n",
    )
    assert problems(path) == [
        f"{path}:7: topics.payments.orders: topic payments.orders matches the globs of several namespaces: "
        'orders ("*.orders"), payments ("payments.*"); '
        "make the globs disjoint so one namespace governs each topic"
    ]


def test_overlapping_globs_without_a_topic_in_both_load(write_yaml: WriteYaml) -> None:
    path = write_yaml(
        "p.yaml",
        "namespaces:\n  payments:\n    topics: payments.*\n  orders:\n    topics: '*.orders'\n"
        "topics:\n  payments.refunds: {}\n",
    )
    policies = load_policies(path)
    with pytest.raises(ConfigError, match="matches the globs of several namespaces"):
        policies.delay_for("payments.orders")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "topics:\n  a:\n    subscriptions:\n      s:\n        outbound: b\n  b: {}\n",
            "4: topics.a.subscriptions.s: outbound topic b is an inbound topic; "
            "the sidecar would consume its own output",
        ),
        (
            "topics:\n  a:\n    subscriptions:\n      s: {}\n  a.s: {}\n",
            "4: topics.a.subscriptions.s: outbound topic a.s (the default) is an inbound topic; the sidecar "
            "would consume its own output",
        ),
        (
            "topics:\n  a:\n    subscriptions:\n      s:\n        outbound: out\n"
            "  b:\n    subscriptions:\n      t:\n        outbound: out\n",
            "8: topics.b.subscriptions.t: outbound topic out is also the outbound topic of "
            "topics.a.subscriptions.s; give each subscription its own",
        ),
        (
            "topics:\n  a:\n    dead_letter_topic: b\n  b: {}\n",
            "3: topics.a.dead_letter_topic: dead-letter topic b is an inbound topic; "
            "rejected records would be consumed again",
        ),
        (
            "topics:\n  a:\n    subscriptions:\n      dlt: {}\n",
            "2: topics.a: dead-letter topic a.dlt (the default) is also the outbound topic of "
            "topics.a.subscriptions.dlt; rejected records would reach that subscription",
        ),
        (
            "topics:\n  a:\n    control_topic: b\n  b: {}\n",
            "3: topics.a.control_topic: control topic b is also an inbound topic; "
            "give the control topic a name of its own",
        ),
        (
            "topics:\n  a:\n    control_topic: b\n    subscriptions:\n      s:\n        outbound: b.outcomes\n",
            "3: topics.a.control_topic: b.outcomes, which goes with control topic b, is also the outbound topic "
            "of topics.a.subscriptions.s; give the control topic a name of its own",
        ),
        (
            "namespaces:\n  n:\n    topics: 'n.*'\n    control_topic: n.c\n"
            "topics:\n  n.a: {}\n  m:\n    dead_letter_topic: n.c.dlt\n",
            "6: topics.n.a: n.c.dlt, which goes with control topic n.c (from namespace n), is also the "
            "dead-letter topic of m; give the control topic a name of its own",
        ),
    ],
)
def test_crossed_topics(write_yaml: WriteYaml, text: str, expected: str) -> None:
    path = write_yaml("p.yaml", text)
    assert problems(path) == [f"{path}:{expected}"]


def test_empty_file_and_null_sections_are_fine(write_yaml: WriteYaml) -> None:
    assert load_policies(write_yaml("empty.yaml", "")).topics == {}
    policies = load_policies(write_yaml("p.yaml", "topics:\n  a:\n    subscriptions:\n      s:\n"))
    assert policies.topics["a"].subscriptions[0].outbound == "a.s"
    assert policies.topics["a"].dead_letter_topic == "a.dlt"
    assert policies.topics["a"].delay.fixed_delivery_delay == Sourced(0, "built-in")


@pytest.mark.parametrize(
    ("written", "ms"),
    [
        ("0", 0),
        ("1500", 1500),
        ("250ms", 250),
        ("30s", 30_000),
        ("5m", 300_000),
        ("2h", 7_200_000),
        ("7d", 604_800_000),
    ],
)
def test_duration_forms(write_yaml: WriteYaml, written: str, ms: int) -> None:
    path = write_yaml("p.yaml", f"defaults:\n  delayed_delivery:\n    max_delivery_delay: {written}\n")
    assert load_policies(path).delay_for("any").max_delivery_delay == Sourced(ms, "defaults")


def test_control_topic_from_the_topic_then_its_namespace_else_the_sidecars(write_yaml: WriteYaml) -> None:
    path = write_yaml(
        "p.yaml",
        "namespaces:\n  pay:\n    topics: 'pay.*'\n    control_topic: pay.control\n"
        "topics:\n  pay.orders: {}\n  pay.refunds:\n    control_topic: refunds.control\n  other: {}\n",
    )
    policies = load_policies(path)
    assert {name: route.control_topic for name, route in policies.topics.items()} == {
        "pay.orders": "pay.control",
        "pay.refunds": "refunds.control",
        "other": None,
    }


def test_by_key_from_the_topic_then_its_namespace_then_the_defaults(write_yaml: WriteYaml) -> None:
    policies = load_policies(
        write_yaml(
            "p.yaml",
            "defaults:\n  delayed_delivery: {by_key: replace}\n"
            "namespaces:\n  pay: {topics: 'pay.*', delayed_delivery: {by_key: none}}\n"
            "topics:\n  pay.a: {}\n  pay.b: {delayed_delivery: {by_key: replace}}\n  other: {}\n",
        )
    )
    assert policies.topics["pay.a"].delay.by_key == Sourced("none", "namespace:pay")
    assert policies.topics["pay.b"].delay.by_key == Sourced("replace", "topic")
    assert policies.topics["other"].delay.by_key == Sourced("replace", "defaults")
    assert [t for t, r in policies.topics.items() if r.delay.keyed] == ["pay.b", "other"]
    assert not load_policies(write_yaml("q.yaml", "topics:\n  a: {}\n")).topics["a"].delay.keyed
