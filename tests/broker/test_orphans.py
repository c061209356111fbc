"""No broker outlives its parent, and the broker the launcher reports ready is its own child.

Each test kills a real process with SIGKILL and watches the real noida-db child. Deadlines are
generous: a test fails only when a process never goes, or never comes.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from sidecar.broker import embedded
from sidecar.broker.base import wait_for_metadata
from sidecar.broker.embedded import EmbeddedBroker, noida_binary, owns_listener
from sidecar.broker.lifeline import die_with_parent
from sidecar.broker.ports import free_port
from sidecar.errors import BrokerError
from tests.kafka_helpers import ROOT

DEADLINE_S = 60.0


def noida_broker_command(port: int, data_dir: Path) -> list[str]:
    """`delay-sidecar broker` on noida-db: the launcher these tests are about (the default is Apache Kafka)."""
    return [sys.executable, "-m", "sidecar", "broker", "--broker-kind", "noida-db", "--port", str(port),
            "--data-dir", str(data_dir)]  # fmt: skip


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.1)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def gone(process: psutil.Process) -> bool:
    """Exited: reaped, or a zombie nobody reaps (re-parented to a PID 1 that does not wait)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _argv(process: psutil.Process) -> list[str]:
    """A child that exits while we look (a killed broker not reaped yet) has no command line."""
    try:
        return process.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return []


def noida_child(parent: psutil.Process) -> psutil.Process:
    found: list[psutil.Process] = []

    def look() -> bool:
        found[:] = [p for p in parent.children(recursive=True) if "noida-db" in " ".join(_argv(p))]
        return bool(found)

    wait_until(look, "the noida-db child appeared")
    return found[0]


@pytest.fixture
def reaper() -> Iterator[list[psutil.Process]]:
    """Processes a failing test would leave behind; killed at the end (these tests started them)."""
    left: list[psutil.Process] = []
    yield left
    for process in left:
        if not gone(process):
            process.kill()


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            preexec_fn=die_with_parent(signal.SIGKILL),  # noqa: PLW1509 - see lifeline
        )


def kill_and_check_broker_goes(parent: subprocess.Popen[bytes], port: int, reaper: list[psutil.Process]) -> None:
    wait_for_metadata(f"127.0.0.1:{port}", timeout_s=DEADLINE_S)
    broker = noida_child(psutil.Process(parent.pid))
    reaper.append(broker)
    parent.send_signal(signal.SIGKILL)
    parent.wait(DEADLINE_S)
    wait_until(lambda: gone(broker), "the orphaned broker stopped")
    wait_until(lambda: not listening(port), "the broker's port was free again")


def test_kill_9_of_the_broker_command_takes_the_broker_with_it(tmp_path: Path, reaper: list[psutil.Process]) -> None:
    port = free_port()
    cli = start(
        noida_broker_command(port, tmp_path / "broker"),
        tmp_path / "cli.log",
    )
    kill_and_check_broker_goes(cli, port, reaper)


def test_kill_9_of_run_in_embedded_mode_takes_the_broker_with_it(tmp_path: Path, reaper: list[psutil.Process]) -> None:
    policies = tmp_path / "policies.yaml"
    policies.write_text("topics:\n  orders:\n    subscriptions:\n      a: {}\n")
    port = free_port()
    run = start(
        [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--policies",
            str(policies),
            "--state-dir",
            str(tmp_path / "state"),
            "--broker-port",
            str(port),
            "--broker-kind",
            "noida-db",
            "--metrics-port",
            "0",
        ],
        tmp_path / "run.log",
    )
    kill_and_check_broker_goes(run, port, reaper)


def test_a_restart_after_kill_9_runs_on_its_own_broker_with_the_data(
    tmp_path: Path, reaper: list[psutil.Process]
) -> None:
    """The trial of issue 12: the second start found the orphan answering and ran against it."""
    port = free_port()
    data_dir = tmp_path / "broker"
    cli = start(
        noida_broker_command(port, data_dir),
        tmp_path / "cli.log",
    )
    bootstrap = f"127.0.0.1:{port}"
    wait_for_metadata(bootstrap, timeout_s=DEADLINE_S)
    first = noida_child(psutil.Process(cli.pid))
    reaper.append(first)
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    for i in range(100):
        producer.produce("kept", str(i).encode())
    assert producer.flush(30) == 0
    cli.send_signal(signal.SIGKILL)
    cli.wait(DEADLINE_S)
    # At once, as a supervisor would restart it: the launcher waits for the old broker to save and go.
    with EmbeddedBroker(data_dir, port=port):
        assert gone(first)
        assert noida_child(psutil.Process()).pid != first.pid
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "check"})
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition("kept", 0), timeout=10)
        finally:
            consumer.close()
        assert (low, high) == (0, 100)


# A broker caught mid-exit: its leader thread is gone (a zombie with no command line) while another
# thread still holds the listener, as a multi-threaded noida-db looks for a moment after SIGTERM.
EXITING_BROKER = """
import ctypes, os, socket, sys, threading, time
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
def finish():
    time.sleep(float(sys.argv[2]))
    listener.close()
    os._exit(0)
threading.Thread(target=finish).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def leader_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]


def test_a_broker_whose_leader_thread_already_exited_is_waited_for_not_taken_for_a_stranger(tmp_path: Path) -> None:
    """The red CI of stop 28: the restart saw the old broker as a zombie still holding the port."""
    port = free_port()
    data_dir = tmp_path / "broker"
    data_dir.mkdir()
    exiting = subprocess.Popen([sys.executable, "-c", EXITING_BROKER, str(port), "3", "noida-db"])
    try:
        (data_dir / embedded.CONTROL_FILE).write_text(f'{{"pid": {exiting.pid}}}')
        wait_until(lambda: listening(port) and leader_state(exiting.pid) == "Z", "the fake broker is mid-exit")
        assert embedded.previous_broker(data_dir) == exiting.pid
        broker = EmbeddedBroker(data_dir, port=port)
        with broker:
            assert exiting.poll() is not None, "the launcher must wait for the exiting broker"
            assert broker.pid is not None and owns_listener(broker.pid, port)
    finally:
        exiting.kill()
        exiting.wait(DEADLINE_S)


@pytest.fixture
def foreign_broker(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A noida-db this test starts itself, holding a port: someone else's broker."""
    port = free_port()
    data_dir = tmp_path / "foreign"
    argv = [str(noida_binary()), "start", "--data-dir", str(data_dir), "--only", "kafka", "--kafka-port", str(port)]
    with (tmp_path / "foreign.log").open("ab") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - see lifeline
        )
    try:
        wait_for_metadata(f"127.0.0.1:{port}", timeout_s=DEADLINE_S)
        yield port, process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            process.kill()


def test_a_port_held_by_another_broker_is_an_error_not_a_ready_broker(
    tmp_path: Path, foreign_broker: tuple[int, subprocess.Popen[bytes]]
) -> None:
    port, _ = foreign_broker
    broker = EmbeddedBroker(tmp_path / "ours", port=port)
    with pytest.raises(BrokerError, match=rf"port {port} on 127.0.0.1 is already in use by another process"):
        broker.start()
    broker.stop()


def test_a_broker_left_on_the_same_data_dir_is_named_with_how_to_stop_it(
    tmp_path: Path, foreign_broker: tuple[int, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, process = foreign_broker
    monkeypatch.setattr(embedded, "TAKEOVER_WAIT_S", 0.5, raising=False)  # it is not going away: fail soon
    broker = EmbeddedBroker(tmp_path / "foreign", port=free_port())
    with pytest.raises(BrokerError, match=rf"pid {process.pid}\) serves .*noida-db down --data-dir"):
        broker.start()
    assert process.poll() is None, "the launcher must not touch a broker that is not its own"


def test_a_broker_that_took_the_data_dir_after_the_launchers_look_is_named_the_same_way(
    tmp_path: Path, foreign_broker: tuple[int, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look before the start can miss a broker that is starting on the same data dir (seen in CI
    under load); noida-db then refuses to start, naming it, and the error says what the look would."""
    _, process = foreign_broker
    monkeypatch.setattr(embedded, "previous_broker", lambda data_dir: None)  # the look saw nothing
    broker = EmbeddedBroker(tmp_path / "foreign", port=free_port())
    with pytest.raises(BrokerError, match=rf"pid {process.pid}\) serves .*noida-db down --data-dir"):
        broker.start()
    assert process.poll() is None, "the launcher must not touch a broker that is not its own"


def test_parent_death_signal_reaches_a_plain_child(tmp_path: Path) -> None:
    """die_with_parent on its own: a grandchild of this test dies when its parent is killed."""
    script = (
        "import subprocess, sys, time\n"
        "from sidecar.broker.lifeline import die_with_parent\n"
        "child = subprocess.Popen(['sleep', '600'], preexec_fn=die_with_parent())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=die_with_parent(signal.SIGKILL),  # noqa: PLW1509 - see lifeline
    )
    assert parent.stdout is not None
    sleeper = psutil.Process(int(parent.stdout.readline()))
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(DEADLINE_S)
        wait_until(lambda: gone(sleeper), "the child of the killed parent stopped")
    finally:
        if not gone(sleeper):
            sleeper.kill()


def test_a_port_still_held_by_a_broker_on_its_way_out_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI, under load, right after a kill -9 of `broker`: the old broker had removed its control
    file but not yet closed its listener, and the next start failed with "port already in use". A
    listener held only by processes that have released their memory (as an exiting one has, before
    its files go) is waited for. Here the listener is this test's, made to look exiting; a live
    process's listener stays an error at once (the test above)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    looked_at: list[int] = []

    def exiting(pid: int) -> bool:
        looked_at.append(pid)
        return True

    monkeypatch.setattr(embedded, "_exiting", exiting)
    threading.Timer(1.0, listener.close).start()
    with EmbeddedBroker(tmp_path / "broker", port=port) as broker:
        wait_for_metadata(broker.bootstrap_servers, timeout_s=DEADLINE_S)
    assert os.getpid() in looked_at


def test_a_listener_that_closes_between_two_looks_is_not_taken_for_a_stranger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI, under load: the port was found in use, and by the time its holders were looked for, the
    listener had closed; the start failed "port already in use". The launcher looks again. (The
    first look is made to see the port in use; no listener is there when the holders are sought.)"""
    port = free_port()
    looks: list[int] = []

    def in_use_at_first(host: str, at: int) -> bool:
        looks.append(at)
        return len(looks) == 1

    monkeypatch.setattr(embedded, "port_in_use", in_use_at_first)
    EmbeddedBroker(tmp_path / "broker", port=port)._claim()
    assert looks == [port, port]
