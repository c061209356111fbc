"""The command line as a user runs it: `python -m sidecar ...`."""

import os
import subprocess
import sys
from pathlib import Path

from sidecar.settings import RunSettings
from tests.kafka_helpers import ROOT


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_demo_runs_to_the_end() -> None:
    result = cli("demo", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rejected: INVALID_DELAY_HEADER" in result.stdout
    assert "done: 13/13 records arrived, 0 early" in result.stdout


def test_run_help_explains_every_flag() -> None:
    result = cli("run", "--help")
    assert result.returncode == 0
    for name, field in RunSettings.model_fields.items():
        assert f"--{name.replace('_', '-')}" in result.stdout
        assert field.description, f"{name} has no help text"


def test_every_flag_has_an_environment_variable(tmp_path: Path) -> None:
    env = {
        "DELAY_SIDECAR_METRICS_PORT": "1234",
        "DELAY_SIDECAR_GROUP_ID": "g7",
        "DELAY_SIDECAR_SASL_PASSWORD": "hunter2",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = RunSettings()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    assert (settings.metrics_port, settings.group_id) == (1234, "g7")
    assert "hunter2" not in repr(settings)
    assert settings.client_config("b:1")["sasl.password"] == "hunter2"


def test_bad_input_gets_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    missing = cli("run", "--policies", str(tmp_path / "nope.yaml"), "--bootstrap-servers", "127.0.0.1:1")
    assert missing.returncode == 2
    assert "policy file not found" in missing.stderr and "Traceback" not in missing.stderr
    bad_port = cli("run", "--metrics-port", "99999")
    assert bad_port.returncode == 2
    assert "--metrics-port" in bad_port.stderr and "Traceback" not in bad_port.stderr
