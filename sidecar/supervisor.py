"""`run --workers N`: N sidecar processes in one consumer group on one host, kept running.

Python runs the loop on one core per process, so a host's cores are used by several processes in
one group, not by threads. The group spreads the partitions over the workers; the supervisor only
starts them, restarts one that dies, and stops them all.

- Worker i runs `delay-sidecar run --workers 1` with the supervisor's settings (passed in the
  environment, so secrets never appear in a process listing) and its own state dir
  (<state-dir>/worker-<i>), static instance id (<instance-id>-<i>) and metrics port
  (<metrics-port> + 1 + i, or 0). A restarted worker has the same id and state dir, so the group
  gives it its partitions back at once, without a rebalance.
- Workers start in turn, each once the one before has joined the group (`_start_in_turn`).
- A worker that exits while the supervisor is not stopping is restarted at once, with a log line
  and `delay_sidecar_workers_restarted_total`. One that dies again within CRASH_LOOP_S of its
  start is restarted after a pause that doubles up to BACKOFF_MAX_S, so a bad setting does not spin.
- Workers die with the supervisor (parent-death signal), even on kill -9, and get SIGTERM: they
  checkpoint and exit as on any stop. The embedded broker is started once, here, and dies with
  the supervisor in the same way.
- The supervisor's own metrics port serves its counters; each worker serves its own.
"""

import http.client
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import SecretStr

from sidecar.app import idle_fetch_pause_ms, launcher_for
from sidecar.broker.embedded import EmbeddedBroker
from sidecar.broker.lifeline import die_with_parent
from sidecar.http import StatusServer
from sidecar.identity import InstanceLock
from sidecar.logs import WORKER_ENV
from sidecar.metrics import PREFIX
from sidecar.policy import load_policies
from sidecar.settings import ENV_PREFIX, RunSettings, default_instance_id

logger = logging.getLogger(__name__)

POLL_S = 0.2
CRASH_LOOP_S = 10.0
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
# A worker's clean stop is a last checkpoint and a group leave: seconds. One that takes longer
# than this is killed; at-least-once delivery makes that safe, but it may send some records twice.
STOP_GRACE_S = 120.0
# Workers start in turn: the next once the one before has joined its group (see _start_in_turn).
JOIN_WAIT_S = 60.0
STAGGER_S = 5.0
"""With --metrics-port 0 no /healthz tells when a worker has joined: workers start this far apart."""
# Set per worker on the command line, which wins over the environment.
PER_WORKER = {"workers", "state_dir", "instance_id", "metrics_port", "bootstrap_servers"}


def worker_state_dir(state_dir: Path, index: int) -> Path:
    return state_dir / f"worker-{index}"


def worker_metrics_port(metrics_port: int, index: int) -> int:
    """0 (no endpoint) stays 0; otherwise the ports after the supervisor's own."""
    return metrics_port + 1 + index if metrics_port else 0


def ready(host: str, port: int) -> bool:
    """A worker's /healthz answers 200: it has joined its group and is serving."""
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host  # a wildcard bind: ask on loopback
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, http.client.HTTPException):
        # Not listening yet, or 503 (HTTPError is an OSError). Or the connect, from an ephemeral port
        # that happened to be this one, reached itself: the "answer" is our own request line.
        return False


def worker_environment(settings: RunSettings) -> dict[str, str]:
    """The settings as DELAY_SIDECAR_* variables, for a worker to read back as they are here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    for name in RunSettings.model_fields:
        value: Any = getattr(settings, name)
        if name in PER_WORKER or value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[ENV_PREFIX + name.upper()] = str(value)
    return env


@dataclass
class Worker:
    index: int
    argv: list[str]
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff: float = 0.0
    restart_at: float | None = None
    restarts: int = field(default=0)


class SupervisorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarted = Counter(
            PREFIX + "workers_restarted",
            "Worker processes that exited while the supervisor was not stopping, and were started again",
            ["worker"],
            registry=self.registry,
        )
        self.running = Gauge(PREFIX + "workers_running", "Worker processes running", registry=self.registry)
        self.configured = Gauge(
            PREFIX + "workers", "Worker processes the supervisor keeps running", registry=self.registry
        )


class Supervisor:
    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.metrics = SupervisorMetrics()
        self._stop = threading.Event()
        self._workers: list[Worker] = []

    def stop(self) -> None:
        """Safe in a signal handler: the main loop does the stopping."""
        self._stop.set()

    def reload_policies(self) -> None:
        for worker in self._workers:
            if worker.process is not None and worker.process.poll() is None:
                worker.process.send_signal(signal.SIGHUP)

    def run(self) -> None:
        """Run in the main thread: the workers' parent-death signal fires when the thread that
        started them ends, and this thread is the one that restarts them."""
        settings = self.settings
        load_policies(Path(settings.policies))  # a bad file fails here, not in a loop of worker restarts
        with ExitStack() as stack:
            base = settings.instance_id or default_instance_id(settings.state_dir)
            stack.callback(InstanceLock(settings.state_dir, settings.group_id, base).close)  # workers lock <base>-<i>
            bootstrap = settings.bootstrap_servers
            paced: list[str] = []  # the workers see the broker as external: it is for the supervisor to say
            if not bootstrap:
                broker = launcher_for(settings)
                stack.callback(broker.stop)
                bootstrap = broker.start()
                paced = ["--idle-fetch-pause-ms", str(idle_fetch_pause_ms(settings.idle_fetch_pause_ms, broker))]
                if isinstance(broker, EmbeddedBroker):
                    logger.warning(
                        "noida-db's group never expires a member that stopped without leaving: workers started "
                        "again may be handed overlapping assignments and deliver a record twice; run --workers 1 "
                        "on it, or use Apache Kafka (--broker-kind apache-kafka) workers=%d",
                        settings.workers,
                    )
            if settings.metrics_port:
                status = StatusServer(
                    settings.metrics_host, settings.metrics_port, self.metrics.registry, self._health, self._policy
                )
                status.start()
                stack.callback(status.stop)
            self._workers = [self._worker(i, bootstrap, paced) for i in range(settings.workers)]
            self.metrics.configured.set(len(self._workers))
            stack.callback(self._stop_workers)
            env = worker_environment(settings)
            self._start_in_turn(env)
            logger.info("workers started workers=%d bootstrap_servers=%s", len(self._workers), bootstrap)
            while not self._stop.wait(POLL_S):
                self._watch(env)

    def _worker(self, index: int, bootstrap: str, extra: list[str]) -> Worker:
        s = self.settings
        base = s.instance_id or default_instance_id(s.state_dir)  # as app.instance_identity
        argv = [
            sys.executable, "-m", "sidecar", "run", "--workers", "1",
            "--bootstrap-servers", bootstrap,
            "--state-dir", str(worker_state_dir(s.state_dir, index)),
            "--instance-id", f"{base}-{index}",
            "--metrics-port", str(worker_metrics_port(s.metrics_port, index)),
            *extra,
        ]  # fmt: skip
        return Worker(index, argv)

    def _start(self, worker: Worker, env: dict[str, str]) -> None:
        worker.process = subprocess.Popen(
            worker.argv,
            env={**env, WORKER_ENV: str(worker.index)},
            process_group=0,  # Ctrl-C reaches the supervisor alone, which stops the workers in order
            preexec_fn=die_with_parent(signal.SIGTERM),  # noqa: PLW1509 - see sidecar/broker/lifeline.py
        )
        worker.started, worker.restart_at = time.monotonic(), None
        self.metrics.running.set(self._running())
        logger.info("worker started worker=%d pid=%d", worker.index, worker.process.pid)

    def _start_in_turn(self, env: dict[str, str]) -> None:
        """Each worker once the one before has joined the group (its /healthz is ready), or after
        JOIN_WAIT_S. Started together, two workers' JoinGroups may reach the empty group about 0.3 s
        apart, which wedges the embedded broker's group: neither is answered until the rebalance
        timeout (5 min), and then one member rejoins forever. On Kafka, joining in turn costs one
        short rebalance per worker."""
        for worker in self._workers:
            self._start(worker, env)
            if worker is not self._workers[-1]:
                self._await_join(worker)

    def _await_join(self, worker: Worker) -> None:
        port = worker_metrics_port(self.settings.metrics_port, worker.index)
        deadline = time.monotonic() + (JOIN_WAIT_S if port else STAGGER_S)
        while not self._stop.wait(POLL_S) and time.monotonic() < deadline:
            if worker.process is None or worker.process.poll() is not None:
                return  # _watch restarts it; the others need not wait for that
            if port and ready(self.settings.metrics_host, port):
                return
        if port and not self._stop.is_set():
            logger.warning(
                "worker has not joined the group in time; starting the next one anyway worker=%d waited_s=%.0f",
                worker.index, JOIN_WAIT_S,
            )  # fmt: skip

    def _watch(self, env: dict[str, str]) -> None:
        now = time.monotonic()
        for worker in self._workers:
            process = worker.process
            if worker.restart_at is not None:
                if now >= worker.restart_at:
                    self._start(worker, env)
                continue
            if process is None or process.poll() is None or self._stop.is_set():
                continue
            worker.restarts += 1
            self.metrics.restarted.labels(str(worker.index)).inc()
            crash_loop = now - worker.started < CRASH_LOOP_S
            pause = worker.backoff if crash_loop else 0.0
            worker.backoff = min(max(worker.backoff * 2, BACKOFF_S), BACKOFF_MAX_S) if crash_loop else 0.0
            logger.error(
                "worker exited; restarting it worker=%d pid=%d exit_code=%s restarts=%d restart_in_s=%.1f",
                worker.index, process.pid, process.returncode, worker.restarts, pause,
            )  # fmt: skip
            worker.restart_at = now + pause
            if pause == 0.0:
                self._start(worker, env)
        self.metrics.running.set(self._running())

    def _running(self) -> int:
        return sum(1 for w in self._workers if w.process is not None and w.process.poll() is None)

    def _health(self) -> tuple[bool, list[str], dict[str, Any]]:
        running = self._running()
        reasons = [] if running == len(self._workers) else [f"{running} of {len(self._workers)} workers running"]
        return not reasons, reasons, {"workers": len(self._workers), "running": running}

    def _policy(self, topic: str) -> dict[str, Any]:
        ports = ", ".join(str(worker_metrics_port(self.settings.metrics_port, w.index)) for w in self._workers)
        return {"topic": topic, "error": f"the supervisor applies no policies; ask a worker's port ({ports})"}

    def _stop_workers(self) -> None:
        """SIGTERM to all at once, so they checkpoint in parallel; a worker that hangs is killed."""
        live = [w.process for w in self._workers if w.process is not None and w.process.poll() is None]
        for process in live:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in live:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.error("worker did not stop; killing it pid=%d grace_s=%.0f", process.pid, STOP_GRACE_S)
                process.kill()
                process.wait()
        self.metrics.running.set(0)
        logger.info("workers stopped workers=%d", len(live))
