"""Free ports for the brokers and sidecars we start: free, below the ephemeral range, and each
handed to one process of ours at a time."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.broker import ports
from sidecar.broker.ports import EPHEMERAL_RANGE, LOWEST_FREE_PORT, free_port, free_ports


def test_a_free_port_lies_below_the_ephemeral_range_where_an_outgoing_connection_could_take_it() -> None:
    """Once a broker on a port from bind(0) stops, any outgoing connection may take that port as its
    local one, and the broker's restart on it finds it in use (a chance failure in test_orphans)."""
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(LOWEST_FREE_PORT <= port < low for port in ports)
    assert len(ports) > 1  # chosen at random, so parallel test workers seldom pick the same one
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: nothing listens there


def test_a_port_handed_to_a_live_process_of_ours_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker stopped to be restarted leaves its ports free; another process of ours asking for a
    free port then must not be handed one of them (a CI run failed on a restarted node's controller
    port, taken by another test worker's sidecar). Nothing listens on the port here: only the
    holder's lock says it is taken, until the holder dies."""
    hold = "from sidecar.broker.ports import free_ports; print(free_ports(2), flush=True); input()"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        held = int(holder.stdout.readline())
        monkeypatch.setattr(ports.random, "randrange", lambda _low, _high: held + 1)  # asks for the second one only
        assert free_port() != held + 1
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert free_port() == held + 1  # the kernel let the lock go with its holder, kill -9 too
    with socket.socket() as s:
        s.bind(("127.0.0.1", held + 1))


def test_one_process_is_not_handed_the_same_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    first = free_ports(2)
    monkeypatch.setattr(ports.random, "randrange", lambda _low, _high: first)
    assert free_port() not in (first, first + 1)


def test_a_folder_of_locks_this_process_cannot_write_still_gives_free_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As when another user of the machine made the folder first (root may write anywhere, so a
    path under a file stands for it here)."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(ports, "RESERVATIONS", tmp_path / "a-file" / "locks")
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    monkeypatch.setattr(ports.random, "randrange", lambda _low, _high: port)
    assert free_port() != port  # still not handed out twice in one process


def reservable_by_another_process(port: int) -> bool:
    answer = subprocess.run(
        [sys.executable, "-c", f"from sidecar.broker.ports import reserve; print(reserve({port}))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return answer.stdout.strip() == "True"
