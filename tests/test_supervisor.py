"""`run --workers N` against the real broker: a killed worker comes back, and nobody outlives the supervisor.

Deliveries are counted per record and read to the high watermark. The kill test runs the workers
in exactly-once mode and reads read_committed: a loss, a duplicate or an early delivery fails.
"""

import os
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sidecar import supervisor as supervision
from sidecar.broker.ports import free_ports
from sidecar.settings import ENV_PREFIX, RunSettings
from sidecar.supervisor import PER_WORKER, Supervisor, Worker, worker_environment
from tests.kafka_helpers import (
    ROOT,
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    TopicFactory,
    broker_kind_of_run,
    deliveries,
    early,
    outbound_end,
    produce_due,
    run_args,
    scrape,
    wait_for,
)

DEADLINE_S = 90.0


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def workers(supervisor: SidecarProcess) -> dict[int, psutil.Process]:
    """The live worker processes by index, told apart by their state dir."""
    assert supervisor.process is not None
    found = {}
    for child in psutil.Process(supervisor.process.pid).children():
        try:
            argv = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        for arg in argv:
            if "/worker-" in arg and not gone(child):
                found[int(arg.rsplit("/worker-", 1)[1])] = child
    return found


def ready(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        return bool(response.status == 200)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def reaper() -> Iterator[list[psutil.Process]]:
    """Processes a failing test would leave behind; killed at the end (this test started them)."""
    left: list[psutil.Process] = []
    yield left
    for process in left:
        if not gone(process):
            process.kill()


@pytest.mark.parametrize("guarantee", ["exactly-once"])  # the strictest: at-least-once may only add duplicates
def test_a_worker_killed_under_load_is_restarted_and_nothing_is_lost(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
    reaper: list[psutil.Process],
    guarantee: str,
) -> None:
    topic, partitions, count = topic_factory("workers", partitions=4), 4, 20_000
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    port = free_ports(3)
    args = run_args(kafka, policies, tmp_path / "state", port, f"g-{topic}", "--workers", "2",
                    "--processing-guarantee", guarantee)  # fmt: skip
    supervisor = SidecarProcess(args, tmp_path / "log")

    def delivered(worker: int) -> float:
        return scrape(port + 1 + worker, "delay_sidecar_messages_delivered_total", topic=topic, subscription="a")

    try:
        supervisor.start()
        wait_for(lambda: scrape(port, "delay_sidecar_workers_running") == 2, DEADLINE_S, "two workers")
        wait_for(lambda: len(workers(supervisor)) == 2, DEADLINE_S, "two worker processes")
        reaper.extend(workers(supervisor).values())
        for worker in (port + 1, port + 2):  # joined: a member joining under load costs a rebalance
            wait_for(lambda w=worker: ready(w), DEADLINE_S, "a worker serving")
        # In turn: started together, their joins could wedge the embedded broker's group for 5 minutes.
        log = supervisor.log.read_text()
        assert log.index("partitions assigned") < log.index('worker started" worker=1'), "worker 1 did not wait"
        due = int(time.time() * 1000) + 5_000
        produce_due(kafka_helper, topic, [due + i % 10_000 for i in range(count)], partitions=partitions)
        # Under load: both workers are delivering when one of them is killed.
        wait_for(lambda: min(delivered(0), delivered(1)) > 0, DEADLINE_S, "both workers delivering")
        victim = workers(supervisor)[0]
        victim.kill()
        wait_for(
            lambda: scrape(port, "delay_sidecar_workers_restarted_total", worker="0") == 1, DEADLINE_S, "a restart"
        )
        wait_for(lambda: workers(supervisor).get(0, victim).pid != victim.pid, DEADLINE_S, "a new worker 0")
        reaper.extend(workers(supervisor).values())
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", partitions) >= count, DEADLINE_S, "every record")
        wait_for(lambda: scrape(port + 1, "delay_sidecar_tracked_messages", topic=topic) == 0, DEADLINE_S, "worker 0")
        running = list(workers(supervisor).values())
        assert supervisor.stop() == 0, supervisor.tail()
        assert all(gone(p) for p in running), "a worker outlived its supervisor's SIGTERM"
    except AssertionError as e:
        # Keep the evidence of a group that did not form.
        raise AssertionError(f"{e}\n--- supervisor and workers' log ---\n{supervisor.tail()}") from None
    finally:
        supervisor.close()
    exact = guarantee == "exactly-once"
    records = kafka_helper.read_to_end(f"{topic}.a", committed_only=exact)
    copies = deliveries(records)
    assert len(copies) == count, f"{count - len(copies)} of {count} records lost"
    assert not early(records)
    duplicates = sum(n - 1 for n in copies.values())
    print(f"worker kill -9 under load: {duplicates} duplicate deliveries of {count} records ({guarantee})")
    if exact:
        assert duplicates == 0, "a read_committed consumer saw a record twice"
    log = supervisor.log.read_text()
    assert 'event="worker exited; restarting it" worker=0' in log
    assert log.count("left the consumer group") == 0, "workers leave only with --leave-group-on-stop"
    # Each worker's lines, on the supervisor's stderr, end with its index.
    assigned = [line for line in log.splitlines() if 'event="partitions assigned"' in line]
    assert {line.rsplit(" ", 1)[-1] for line in assigned} == {"worker=0", "worker=1"}, assigned


@pytest.mark.broker  # a local broker of its own
@pytest.mark.parametrize("kind", ["of the run", "noida-db"])
def test_kill_9_of_the_supervisor_takes_the_workers_and_the_local_broker_with_it(
    tmp_path: Path, reaper: list[psutil.Process], kind: str
) -> None:
    """On noida-db the supervisor also warns that workers need a group that expires members, and
    paces their idle fetches."""
    policies = tmp_path / "policies.yaml"
    policies.write_text("topics:\n  orders:\n    subscriptions:\n      a: {}\n")
    port, broker_port = free_ports(3), free_ports(2)
    kind = broker_kind_of_run() if kind == "of the run" else kind
    args = ["--policies", str(policies), "--state-dir", str(tmp_path / "state"), "--metrics-port", str(port),
            "--broker-port", str(broker_port), "--broker-kind", kind, "--workers", "2"]  # fmt: skip
    supervisor = SidecarProcess(args, tmp_path / "log").start()
    try:
        assert supervisor.process is not None
        wait_for(lambda: scrape(port, "delay_sidecar_workers_running") == 2, DEADLINE_S, "two workers")
        for worker in (port + 1, port + 2):  # each serves: the one broker the supervisor started is theirs
            wait_for(lambda w=worker: ready(w), DEADLINE_S, "a worker serving")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/policies/orders", timeout=5) as response:
            assert f"ask a worker's port ({port + 1}, {port + 2})" in response.read().decode()
        family = psutil.Process(supervisor.process.pid).children(recursive=True)
        reaper.extend(family)
        brokers = [p for p in family if any(m in " ".join(p.cmdline()) for m in ("noida-db start", "kafka.Kafka"))]
        assert len(brokers) == 1, f"one local broker for all workers, not {len(brokers)}"
        assert len(workers(supervisor)) == 2
        assert ("noida-db's group never expires" in supervisor.log.read_text()) == (kind == "noida-db")
        # noida-db answers an empty fetch at once; a worker, handed its address, cannot tell.
        argvs = [w.cmdline() for w in workers(supervisor).values()]
        assert {a[a.index("--idle-fetch-pause-ms") + 1] for a in argvs} == {"10" if kind == "noida-db" else "0"}
        supervisor.kill()
        wait_for(lambda: all(gone(p) for p in family), DEADLINE_S, "the workers and the broker gone")
        wait_for(lambda: not listening(broker_port), DEADLINE_S, "the broker port free")
    finally:
        supervisor.close()


def test_a_worker_reads_the_supervisors_settings_back_from_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every setting but the per-worker ones reaches the workers as it is, secrets included (not in argv)."""
    settings = RunSettings(
        bootstrap_servers="k:9092",
        state_dir=tmp_path,
        sasl_password="hunter2",
        leave_group_on_stop=True,
        tracker="memory",
        read_ahead_ms=1234,
        workers=3,
    )
    env = worker_environment(settings)
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    worker = RunSettings()
    for name in RunSettings.model_fields:
        if name not in PER_WORKER:
            assert getattr(worker, name) == getattr(settings, name), name
    assert worker.workers == 1 and worker.bootstrap_servers is None  # set on each worker's command line


def test_a_worker_that_keeps_dying_at_start_is_restarted_with_growing_pauses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad setting must not spin the host: the first restart is at once, the next ones wait longer."""
    settings = RunSettings(
        bootstrap_servers="k:9092", state_dir=tmp_path, policies=ROOT / "policies", metrics_port=0, workers=2
    )
    supervisor = Supervisor(settings)
    monkeypatch.setattr(supervision, "BACKOFF_S", 0.05)
    monkeypatch.setattr(Supervisor, "_worker", lambda self, i, b, extra: Worker(i, [sys.executable, "-c", "exit(3)"]))

    def restarts() -> float:
        value = supervisor.metrics.registry.get_sample_value("delay_sidecar_workers_restarted_total", {"worker": "1"})
        return value or 0.0

    thread = threading.Thread(target=supervisor.run)
    thread.start()
    try:
        wait_for(lambda: restarts() >= 4, DEADLINE_S, "four restarts")
    finally:
        supervisor.stop()
        thread.join(DEADLINE_S)
    assert not thread.is_alive()
    assert supervisor._workers[1].backoff > 0.3  # 0, 0.05, 0.1, 0.2 before the 4 restarts


def test_a_worker_port_that_echoes_the_request_is_not_ready_and_does_not_stop_the_supervisor() -> None:
    """A connect to a port nobody listens on yet can come from an ephemeral port that is that very
    port, and reach itself: urllib then reads its own request line and raises BadStatusLine. The CI
    saw it once; here an echoing socket stands in for the self-connect."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def echo() -> None:
            connection, _ = server.accept()
            with connection:
                connection.sendall(connection.recv(4096))

        thread = threading.Thread(target=echo, daemon=True)
        thread.start()
        assert supervision.ready("127.0.0.1", server.getsockname()[1]) is False
        thread.join(10)
