"""Ports for the brokers we start: free ones, and whether one is taken."""

import errno
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

from sidecar.errors import BrokerError

LOWEST_FREE_PORT = 20_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RESERVATIONS = Path(tempfile.gettempdir()) / "delay-sidecar-ports"


_held: dict[int, int | None] = {}
"""Port -> descriptor of this process's lock on it, open for as long as it lives (None: no lock
could be taken, and the port is still never handed out twice here)."""


def reserve(port: int) -> bool:
    """Whether this process holds the port (now or already), for as long as it lives.

    A free port stays free only while nothing else asks: when a broker we started is stopped to be
    restarted on its ports, another process of ours asking for a free port could be handed one of
    them, and the restart finds it in use (a CI run failed so: a test worker's sidecar took the
    controller port of the node another worker was restarting). A lock per port keeps our processes
    from handing out each other's ports; the kernel lets it go when its holder dies, kill -9 too."""
    if port in _held:
        return True
    try:
        RESERVATIONS.mkdir(parents=True, exist_ok=True)
        fd = os.open(RESERVATIONS / str(port), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:  # a folder another user made, say: no lock to take, and the port was free when asked
        _held[port] = None
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held[port] = fd
    return True


def _fresh(port: int) -> bool:
    """Free, and not handed out before by this process or another of ours that still lives."""
    return port not in _held and _bindable(port) and reserve(port)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on, below the kernel's range of ephemeral ports where it can.

    A port from bind(0) lies in that range: once its listener goes (a broker restarted on its
    port), any outgoing connection on the host may take it as its local port, and the restart finds
    it in use. That failed a test by chance (tests/broker/test_orphans.py, in CI). A port below the
    range is only ever taken by a listener or an explicit bind."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low > LOWEST_FREE_PORT:
        for _ in range(100):
            port = random.randrange(LOWEST_FREE_PORT, low)
            if _fresh(port):
                return port
    while True:  # no range to stay below, or nothing free below it: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if _fresh(port):
            return port


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (a supervisor's, then one per worker)."""
    while True:
        base = free_port()
        if all(_fresh(port) for port in range(base + 1, base + count)):
            return base


def port_in_use(host: str, port: int) -> bool:
    """Whether a listener holds the port; binds as noida-db does (SO_REUSEADDR), so TIME_WAIT does not count."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise BrokerError(f"cannot resolve {host} for the broker ({e}); check --host") from e
    with socket.socket(family, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise BrokerError(f"cannot bind {host}:{port} for the broker ({e}); check --host") from e
    return False
