"""`policies show | validate | set-delayed-delivery`, through the same CLI models the lead mounts."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, SettingsConfigDict

from sidecar.errors import ConfigError
from sidecar.policy import PolicyError, load_policies
from sidecar.policy.commands import PoliciesCommand, effective_policy_json
from sidecar.policy.edit import Level, edit_delayed_delivery, set_delayed_delivery
from sidecar.policy.loader import EMPTY_POLICY

WriteYaml = Callable[..., Path]

COMMENTED = """\
# Payments team policies. Ask #payments-oncall before changing limits.
defaults:                          # the sidecar-wide level
  delayed_delivery:
    enabled: true
    max_delivery_delay: 7d         # 0 = no limit
    fixed_delivery_delay: 0        # 0 = off

namespaces:
  payments:
    topics: "payments.*"           # glob over topic names
    delayed_delivery:
      max_delivery_delay: 1d

# inbound topics
topics:
  payments.orders:                 # checkout writes here
    dead_letter_topic: payments.orders.dlt
    subscriptions:
      billing: {}                  # outbound payments.orders.billing
      audit:
        type: exclusive
  payments.refunds:
    delayed_delivery:
      fixed_delivery_delay: 30m    # regulator asks for a cooling-off period
    subscriptions:
      ledger: {}
"""


class App(BaseSettings):
    model_config = SettingsConfigDict(cli_kebab_case=True, cli_prog_name="delay-sidecar")
    policies: CliSubCommand[PoliciesCommand]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def run(*args: str) -> int:
    try:
        CliApp.run(App, cli_args=["policies", *args])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.mark.parametrize(
    ("level", "values", "before", "after"),
    [
        (
            Level("defaults"),
            {"max_delivery_delay": "14d"},
            "    max_delivery_delay: 7d         # 0 = no limit\n",
            "    max_delivery_delay: 14d        # 0 = no limit\n",
        ),
        (
            Level("namespace", "payments"),
            {"max_delivery_delay": 0},
            "      max_delivery_delay: 1d\n",
            "      max_delivery_delay: 0\n",
        ),
        (
            Level("topic", "payments.refunds"),
            {"fixed_delivery_delay": "1h"},
            "      fixed_delivery_delay: 30m    # regulator",
            "      fixed_delivery_delay: 1h     # regulator",
        ),
        (
            Level("namespace", "payments"),
            {"fixed_delivery_delay": "5m"},
            "      max_delivery_delay: 1d\n",
            "      max_delivery_delay: 1d\n      fixed_delivery_delay: 5m\n",
        ),
        (
            Level("namespace", "payments"),
            {"enabled": False},
            "    delayed_delivery:\n      max_delivery_delay: 1d\n",
            "    delayed_delivery:\n      enabled: false\n      max_delivery_delay: 1d\n",
        ),
        (
            Level("topic", "payments.orders"),
            {"max_delivery_delay": "2h"},
            "        type: exclusive\n",
            "        type: exclusive\n    delayed_delivery:\n      max_delivery_delay: 2h\n",
        ),
        (
            Level("topic", "payments.new"),
            {"fixed_delivery_delay": 1500},
            "      ledger: {}\n",
            "      ledger: {}\n  payments.new:\n    delayed_delivery:\n      fixed_delivery_delay: 1500\n",
        ),
    ],
)
def test_edit_changes_only_the_edited_value(
    write_yaml: WriteYaml, level: Level, values: dict[str, int | str | bool], before: str, after: str
) -> None:
    path = write_yaml("p.yaml", COMMENTED)
    assert COMMENTED.count(before) == 1
    set_delayed_delivery(path, level, values)
    assert path.read_text() == COMMENTED.replace(before, after)


def test_edit_of_a_last_key_keeps_the_blank_line_before_the_next_section() -> None:
    text = "defaults:\n  delayed_delivery:\n    max_delivery_delay: 1d   # limit\n\n# topics below\ntopics: {}\n"
    out = edit_delayed_delivery(text, Path("p.yaml"), Level("defaults"), {"fixed_delivery_delay": "1m"})
    assert out == (
        "defaults:\n  delayed_delivery:\n    max_delivery_delay: 1d   # limit\n"
        "    fixed_delivery_delay: 1m\n\n"
        "# topics below\ntopics: {}\n"
    )


def test_four_space_indentation_is_kept() -> None:
    text = "defaults:\n    delayed_delivery:\n        max_delivery_delay: 1d\n"
    out = edit_delayed_delivery(text, Path("p.yaml"), Level("defaults"), {"max_delivery_delay": "2d"})
    assert out == text.replace("1d", "2d")


def test_an_invalid_result_is_never_written(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", COMMENTED)
    with pytest.raises(PolicyError) as caught:
        set_delayed_delivery(path, Level("namespace", "nope"), {"max_delivery_delay": "1d"})
    assert (
        str(caught.value)
        == f"{path}: namespaces.nope: not defined in this file; add the namespace with its topics glob first"
    )
    with pytest.raises(PolicyError) as caught:  # a new topic whose default outbound is an inbound topic
        set_delayed_delivery(path, Level("topic", "payments.orders.billing"), {"max_delivery_delay": "1d"})
    assert "is an inbound topic" in str(caught.value)
    assert path.read_text() == COMMENTED
    assert [p.name for p in path.parent.iterdir()] == ["p.yaml"]  # no temp file left behind


def test_an_edit_is_checked_against_the_rest_of_the_directory(write_yaml: WriteYaml) -> None:
    a = write_yaml("policies/a.yaml", "namespaces:\n  payments:\n    topics: payments.*\n")
    b = write_yaml("policies/b.yaml", "topics:\n  payments.orders: {}\n")
    with pytest.raises(PolicyError) as caught:
        set_delayed_delivery(a, Level("topic", "payments.orders"), {"max_delivery_delay": "1d"}, a.parent)
    assert str(caught.value) == f"{b}:2: topics.payments.orders: already defined in {a}; keep one"
    assert load_policies(a.parent).topics["payments.orders"].namespace == "payments"


def test_cli_set_delayed_delivery(write_yaml: WriteYaml, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml("p.yaml", COMMENTED)
    assert run("set-delayed-delivery", "--namespace", "payments", "--max-delay", "12h", "--file", str(path)) == 0
    assert path.read_text() == COMMENTED.replace("max_delivery_delay: 1d", "max_delivery_delay: 12h")
    assert capsys.readouterr().out == f"updated {path}: namespace payments\n"
    assert run("set-delayed-delivery", "--defaults", "--disable", "--file", str(path)) == 0
    assert "    enabled: false\n" in path.read_text()
    assert run("set-delayed-delivery", "--topic", "payments.refunds", "--by-key", "replace", "--file", str(path)) == 0
    assert load_policies(path).topics["payments.refunds"].delay.keyed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--topic", "a", "--defaults", "--max-delay", "1d"],
            "give exactly one of --topic, --namespace or --defaults",
        ),
        (["--max-delay", "1d"], "give exactly one of --topic, --namespace or --defaults"),
        (["--topic", "a", "--enable", "--disable"], "give --enable or --disable, not both"),
        (
            ["--topic", "a", "--max-delay", "soon"],
            "--max-delay: expected a duration (ms integer or 250ms, 30s, 5m, 2h, 7d), got 'soon'",
        ),
        (["--topic", "a", "--by-key", "latest"], "--by-key takes none or replace, not 'latest'"),
        (["--topic", "a"], "{file}: nothing to set: give --max-delay, --fixed-delay, --enable, --disable or --by-key"),
    ],
)
def test_cli_set_errors(
    write_yaml: WriteYaml, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    path = write_yaml("p.yaml", COMMENTED)
    assert run("set-delayed-delivery", *args, "--file", str(path)) == 2
    assert capsys.readouterr().err == f"error: {message.format(file=path)}\n"
    assert path.read_text() == COMMENTED


def test_cli_set_without_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("set-delayed-delivery", "--defaults", "--max-delay", "1d") == 2
    assert capsys.readouterr().err == "error: give --file FILE, the policy file to edit\n"


def test_cli_validate(write_yaml: WriteYaml, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_yaml("good.yaml", COMMENTED)
    bad = write_yaml("bad.yaml", "topics:\n  a:\n    subscriptions:\n      s: {type: x}\n  b: {dead_letter_topic: 1}\n")
    assert run("validate", str(good)) == 0
    assert capsys.readouterr().out == f"ok {good}: 2 topics, 1 namespaces, defaults set\n"
    assert run("validate", str(good), str(bad)) == 1
    out, err = capsys.readouterr()
    assert out == f"ok {good}: 2 topics, 1 namespaces, defaults set\n"
    assert err.splitlines() == [
        f"{bad}:4: topics.a.subscriptions.s.type: expected one of shared, key_shared, exclusive, failover, got 'x'",
        f"{bad}:5: topics.b.dead_letter_topic: expected a Kafka topic name, got 1",
    ]


def test_cli_validate_refuses_a_policy_without_topics(
    write_yaml: WriteYaml, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 12: `validate` said ok to an empty file, which the sidecar then ran with no topics."""
    empty = write_yaml("empty.yaml", "")
    defaults_only = write_yaml("defaults.yaml", "defaults:\n  delayed_delivery: {max_delivery_delay: 1h}\n")
    assert run("validate", str(empty), str(defaults_only)) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"{empty}: {EMPTY_POLICY}", f"{defaults_only}: {EMPTY_POLICY}"]
    on_purpose = write_yaml("none.yaml", "allow_empty: true\ntopics: {}\n")
    assert run("validate", str(on_purpose)) == 0
    assert capsys.readouterr().out == f"ok {on_purpose}: 0 topics, 0 namespaces, defaults not set\n"


def test_cli_show(write_yaml: WriteYaml, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml("p.yaml", COMMENTED)
    assert run("show", "payments.refunds", "--policies", str(path)) == 0
    assert capsys.readouterr().out == (
        "topic payments.refunds\n"
        "  namespace: payments\n"
        f"  policies generation 1 from {path}\n"
        "  setting               value             from\n"
        "  enabled               true              defaults\n"
        "  max_delivery_delay    1d (86400000 ms)  namespace:payments\n"
        "  fixed_delivery_delay  30m (1800000 ms)  topic\n"
        "  by_key                none              built-in\n"
        "  dead_letter_topic: payments.refunds.dlt\n"
        "  control_topic: the sidecar's --control-topic\n"
        "  subscriptions:\n"
        "    ledger: shared -> payments.refunds.ledger\n"
    )
    assert run("show", "payments.orders", "--policies", str(path), "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["subscriptions"][1] == {
        "name": "audit",
        "outbound": "payments.orders.audit",
        "type": "exclusive",
        "ordered": True,
    }


def test_cli_show_uses_the_environment(
    write_yaml: WriteYaml, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_yaml("p.yaml", COMMENTED)
    monkeypatch.setenv("DELAY_SIDECAR_POLICIES", str(path))
    assert run("show", "other") == 0
    assert "not declared under topics" in capsys.readouterr().out


def test_cli_show_with_a_broken_policy(write_yaml: WriteYaml, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml("p.yaml", "topics: [a]\n")
    assert run("show", "a", "--policies", str(path)) == 2
    assert capsys.readouterr().err == f"error: {path}:1: topics: expected a mapping, got a list\n"


def test_effective_policy_json_of_an_undeclared_topic(write_yaml: WriteYaml) -> None:
    policies = load_policies(write_yaml("p.yaml", COMMENTED))
    assert effective_policy_json(policies, "payments.fx") == {
        "topic": "payments.fx",
        "declared": False,
        "namespace": "payments",
        "generation": 1,
        "delayed_delivery": {
            "enabled": {"value": True, "source": "defaults"},
            "max_delivery_delay_ms": {"value": 86_400_000, "source": "namespace:payments"},
            "fixed_delivery_delay_ms": {"value": 0, "source": "defaults"},
            "by_key": {"value": "none", "source": "built-in"},
        },
        "dead_letter_topic": None,
        "control_topic": None,
        "subscriptions": [],
    }
    no_defaults = load_policies(write_yaml("q.yaml", "topics:\n  a: {}\n"))
    assert effective_policy_json(no_defaults, "b")["delayed_delivery"]["enabled"] == {
        "value": True,
        "source": "built-in",
    }


def test_effective_policy_json_with_overlapping_globs(write_yaml: WriteYaml) -> None:
    policies = load_policies(write_yaml("p.yaml", "namespaces:\n  a:\n    topics: 'x.*'\n  b:\n    topics: '*.y'\n"))
    with pytest.raises(ConfigError):
        effective_policy_json(policies, "x.y")
