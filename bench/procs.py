"""Child processes of a bench run: the sidecar, the ceiling relay, the load generator, py-spy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.probe import scrape
from sidecar.app import EMBEDDED_IDLE_FETCH_PAUSE_MS
from sidecar.broker import BrokerKind, BrokerLauncher, EmbeddedBroker, local_broker
from sidecar.broker.lifeline import die_with_parent
from sidecar.broker.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def _dies_with_us() -> Callable[[], None] | None:
    """SIGKILL on the bench's death: an interrupted run must not leave sidecars or load generators behind."""
    return die_with_parent(signal.SIGKILL)


class Child:
    """A child process with its output in a log file; stop() asks politely, then kills."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        """`env`: variables added to this process's own."""
        self.argv = argv
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, **(env or {})},
                preexec_fn=_dies_with_us(),  # noqa: PLW1509 - see sidecar/broker/lifeline.py
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; a child that did not stop leaves its Python stacks
        in its log first (py-spy dump), so the run that found it also says where it was stuck."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._dump_stacks(timeout_s)
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def _dump_stacks(self, waited_s: float) -> None:
        binary = py_spy()
        with self.log.open("ab") as out:
            heading = f"\n[bench] pid {self.pid} running {waited_s:.0f} s after SIGTERM; its stacks (py-spy dump):\n"
            out.write(heading.encode())
            out.flush()  # before py-spy writes to the same file
            if binary is None:
                out.write(b"[bench] py-spy is not installed\n")
                return
            try:
                dump = [binary, "dump", "--pid", str(self.pid)]
                subprocess.run(dump, stdout=out, stderr=out, timeout=30, check=False)
            except subprocess.TimeoutExpired:
                out.write(b"[bench] py-spy dump timed out\n")

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def start_sidecar(
    bootstrap: str, policies: Path, state_dir: Path, metrics_port: int, group: str, log: Path, *extra: str
) -> Child:
    state_dir.mkdir(parents=True, exist_ok=True)
    child = Child(
        [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--bootstrap-servers",
            bootstrap,
            "--policies",
            str(policies),
            "--state-dir",
            str(state_dir),
            "--metrics-port",
            str(metrics_port),
            "--group-id",
            group,
            "--log-level",
            "WARNING",
            *extra,
        ],
        log,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"the sidecar exited with code {child.process.returncode}:\n{child.tail()}")
        try:
            scrape(metrics_port, timeout_s=0.5)
            return child
        except OSError:
            time.sleep(0.1)
    child.stop()
    raise RuntimeError(f"the sidecar's metrics endpoint did not answer within 60 s:\n{child.tail()}")


def start_relay(
    bootstrap: str, inbound: str, outbound: list[str], group: str, log: Path, contract_headers: bool = False
) -> Child:
    each = [arg for topic in outbound for arg in ("--outbound", topic)]
    extra = ["--contract-headers"] if contract_headers else []
    argv = [sys.executable, "-m", "bench.relay", "--bootstrap", bootstrap, "--inbound", inbound, "--group", group]
    return Child([*argv, *each, *extra], log)


def load_argv(
    bootstrap: str,
    topic: str,
    records: int,
    mode: str = "none",
    base_ms: int = 0,
    window_ms: int = 0,
    rate: float = 0.0,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.load",
        "--bootstrap",
        bootstrap,
        "--topic",
        topic,
        "--records",
        str(records),
        "--mode",
        mode,
        "--base-ms",
        str(base_ms),
        "--window-ms",
        str(window_ms),
        "--rate",
        str(rate),
    ]


def run_load(argv: list[str], log: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the load generator to the end; its stats."""
    with log.open("ab") as err:
        done = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
            timeout=timeout_s,
            check=False,
            preexec_fn=_dies_with_us(),
        )
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed with code {done.returncode}; see {log}")
    stats: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return stats


def start_load(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as err:
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
            preexec_fn=_dies_with_us(),  # noqa: PLW1509 - see sidecar/broker/lifeline.py
        )


def finish_load(process: subprocess.Popen[bytes], timeout_s: float = 600.0) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout_s)
    if process.returncode != 0:
        raise RuntimeError(f"the load generator failed with code {process.returncode}")
    stats: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return stats


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return found if Path(found).exists() else None


def start_profiler(pid: int, out: Path, log: Path) -> Child | None:
    """py-spy sampling the sidecar at 100 Hz, collapsed stacks (flamegraph input), until it exits."""
    binary = py_spy()
    if binary is None:
        return None
    return Child(
        [binary, "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--nonblocking", "-o", str(out)], log
    )


def bench_broker(data_dir: Path) -> BrokerLauncher:
    """The broker a bench run starts: Apache Kafka unless DELAY_SIDECAR_BROKER_KIND says otherwise
    (noida-db for the fallback's figures), with DELAY_SIDECAR_NODES nodes (default 1). Every table
    names it (its `description`)."""
    named = os.environ.get("DELAY_SIDECAR_BROKER_KIND", "apache-kafka")
    kinds: dict[str, BrokerKind] = {"auto": "auto", "apache-kafka": "apache-kafka", "noida-db": "noida-db"}
    if named not in kinds:
        raise SystemExit(f"DELAY_SIDECAR_BROKER_KIND={named}: use apache-kafka, noida-db or auto")
    nodes = int(os.environ.get("DELAY_SIDECAR_NODES", "1"))
    broker = local_broker(kinds[named], data_dir, port=free_port(), nodes=nodes)
    if isinstance(broker, EmbeddedBroker):  # the bench's sidecars are handed its address: they cannot tell
        os.environ.setdefault("DELAY_SIDECAR_IDLE_FETCH_PAUSE_MS", str(EMBEDDED_IDLE_FETCH_PAUSE_MS))
    return broker
