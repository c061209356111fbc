"""The loader, fed anything, either loads or raises ConfigError: a bad edit must never crash a reload."""

import contextlib
import io
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from sidecar.errors import ConfigError
from sidecar.policy import load_policies
from sidecar.policy.edit import Level, edit_delayed_delivery

# Keys of the real schema, so generated documents get past the top level and exercise deep validation.
KEYS = st.sampled_from(
    [
        "defaults",
        "namespaces",
        "topics",
        "delayed_delivery",
        "enabled",
        "max_delivery_delay",
        "fixed_delivery_delay",
        "dead_letter_topic",
        "control_topic",
        "subscriptions",
        "outbound",
        "type",
        "payments",
        "payments.orders",
        "billing",
        "exclusive",
    ]
) | st.text(max_size=8)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(["7d", "30m", "0", "-1s", "payments.*", "shared", "exclusive", "1e3", "~", "yes"])
)
DOCUMENTS = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(KEYS, children, max_size=5),
    max_leaves=30,
)

# Naming suppress_health_check replaces the suite profile's list (tests/conftest.py): keep too_slow in it.
SUPPRESSED = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture(scope="module")
def policy_file() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp) / "p.yaml"


def dump(data: Any) -> str:
    out = io.StringIO()
    YAML(typ="safe", pure=True).dump(data, out)
    return out.getvalue()


@settings(max_examples=300, deadline=None, suppress_health_check=SUPPRESSED)
@given(text=st.text(max_size=200))
def test_arbitrary_text(policy_file: Path, text: str) -> None:
    policy_file.write_text(text, encoding="utf-8")
    with contextlib.suppress(ConfigError):
        load_policies(policy_file)


@settings(max_examples=300, deadline=None, suppress_health_check=SUPPRESSED)
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes(policy_file: Path, raw: bytes) -> None:
    policy_file.write_bytes(raw)
    with contextlib.suppress(ConfigError):
        load_policies(policy_file)


@settings(max_examples=400, deadline=None, suppress_health_check=SUPPRESSED)
@given(data=DOCUMENTS)
def test_arbitrary_documents(policy_file: Path, data: Any) -> None:
    policy_file.write_text(dump(data), encoding="utf-8")
    try:
        load_policies(policy_file)
    except ConfigError as e:
        assert str(e)


@settings(max_examples=200, deadline=None)
@given(data=DOCUMENTS, level=st.sampled_from([Level("defaults"), Level("topic", "t"), Level("namespace", "n")]))
def test_edits_of_arbitrary_documents(data: Any, level: Level) -> None:
    with contextlib.suppress(ConfigError):
        edit_delayed_delivery(dump(data), Path("p.yaml"), level, {"max_delivery_delay": "1d"})
