"""Ports for the brokers we start: free ones, and whether one is taken."""

import errno
import random
import socket
from pathlib import Path

from sidecar.errors import BrokerError

LOWEST_FREE_PORT = 20_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


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
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no range to stay below, or nothing free below it: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (a supervisor's, then one per worker)."""
    while True:
        base = free_port()
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


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
