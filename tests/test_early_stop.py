"""A SIGTERM that comes while the sidecar's libraries load (sidecar/early_stop.py)."""

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# `python -m sidecar run`, with SIGTERM sent to itself at the first import of confluent_kafka: about
# when the churn bench's members stopped just after a start were hit (exit -15 before the fix).
SIGNALLED_AT_IMPORT = """
import builtins, os, runpy, signal, sys
real_import = builtins.__import__
sent = []
def hook(name, *args, **kwargs):
    if name == "confluent_kafka" and not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
    return real_import(name, *args, **kwargs)
builtins.__import__ = hook
sys.argv = ["delay-sidecar", "run", "--bootstrap-servers", "127.0.0.1:1", "--policies", "p.yaml"]
runpy.run_module("sidecar", run_name="__main__", alter_sys=True)
"""


def test_a_sigterm_while_the_libraries_load_ends_the_sidecar_with_exit_0(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLED_AT_IMPORT], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "SIGTERM while starting; stopped before doing anything" in done.stderr, done.stderr[-2000:]


def test_after_the_start_sigterm_and_ctrl_c_are_handled_as_usual() -> None:
    """`take` hands the signals back: a command other than `run` keeps Python's own handling."""
    from sidecar import early_stop  # noqa: PLC0415 - its install() would replace pytest's handlers

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        assert early_stop.take() is None
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
