"""A cluster someone else runs: wrong security settings get one clear error, and a stop is prompt."""

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sidecar.broker.external import ExternalBroker
from sidecar.broker.ports import free_port
from sidecar.errors import ConfigError
from tests.kafka_helpers import ROOT, sidecar_process, wait_for

SCRAM = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
         "sasl.username": "u", "sasl.password": "p"}  # fmt: skip


def test_sasl_against_a_plaintext_listener_names_the_cause(kafka: str) -> None:
    with pytest.raises(ConfigError, match=r"SASL .*--security-protocol"):
        ExternalBroker(kafka, SCRAM).start()


def test_a_missing_ca_file_names_the_setting(kafka: str) -> None:
    config = {"security.protocol": "SASL_SSL", "ssl.ca.location": "/nonexistent/ca.pem", **{
        k: v for k, v in SCRAM.items() if k != "security.protocol"}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"ssl\.ca\.location"):
        ExternalBroker(kafka, config).start()


def test_a_stop_while_waiting_for_the_cluster_returns_at_once() -> None:
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    ExternalBroker(f"127.0.0.1:{free_port()}", {}, stop).start()  # nothing listens: would wait 30 s
    assert stop.is_set()


def policies(tmp_path: Path) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text("topics:\n  orders:\n    subscriptions: {a: {}}\n")
    return path


def run(kafka: str, tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--bootstrap-servers", kafka, "--policies", str(policies(tmp_path)),
         "--state-dir", str(tmp_path / "state"), "--metrics-port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip


def test_run_with_wrong_sasl_settings_exits_2_with_one_line_and_no_traceback(kafka: str, tmp_path: Path) -> None:
    process = run(kafka, tmp_path, "--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism", "SCRAM-SHA-512",
                  "--sasl-username", "u", "--sasl-password", "secret-value")  # fmt: skip
    output = process.communicate(timeout=60)[0].decode()
    assert process.returncode == 2, output
    errors = [line for line in output.splitlines() if line.startswith("delay-sidecar: error:")]
    assert len(errors) == 1 and "SASL" in errors[0] and "--security-protocol" in errors[0], output
    assert "Traceback" not in output and "%3|" not in output and "secret-value" not in output


def test_sigterm_while_the_cluster_does_not_answer_exits_promptly(tmp_path: Path) -> None:
    log = tmp_path / "log"
    process = sidecar_process(["--bootstrap-servers", f"127.0.0.1:{free_port()}", "--policies",
                               str(policies(tmp_path)), "--state-dir", str(tmp_path / "state"),
                               "--metrics-port", "0"], log)  # fmt: skip
    wait_for(lambda: "policies loaded" in log.read_text(), 30, "the signal handlers")  # set before loading
    process.send_signal(signal.SIGTERM)
    wait_for(lambda: process.poll() is not None, 10, "the exit")  # the wait for the cluster is 30 s
    assert process.returncode == 0, log.read_text()
    assert "Traceback" not in log.read_text()
