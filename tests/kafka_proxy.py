"""A TCP proxy before one Kafka broker that can drop chosen requests on the floor.

For faults no broker makes on demand: a request the broker never sees and never answers, as a
client sees it when the broker, or librdkafka's handling of it, loses the request. The broker must
advertise the proxy's address (advertised.listeners), so that every connection a client opens after
its bootstrap goes through it too.
"""

import contextlib
import socket
import struct
import threading
from collections import Counter
from collections.abc import Collection

INIT_PRODUCER_ID = 22
"""The api key of the request an idempotent producer gets its producer id with."""
JOIN_GROUP, HEARTBEAT = 11, 12
"""The api keys of a classic group member's join and its heartbeat."""


class KafkaProxy:
    def __init__(self, port: int, broker_port: int, host: str = "127.0.0.1") -> None:
        self.port, self.broker = port, (host, broker_port)
        """Where requests go: set it again if the broker's launcher moved to other ports."""
        self._drop: frozenset[int] = frozenset()
        self.dropped: Counter[int] = Counter()
        """How many requests were dropped so far, by api key."""
        self._listener = socket.create_server((host, port))
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="kafka-proxy", daemon=True).start()

    def drop(self, api_keys: Collection[int]) -> None:
        """From now on, requests with these api keys go nowhere (none: forward everything)."""
        self._drop = frozenset(api_keys)

    def close(self) -> None:
        self._closed = True
        _close(self._listener, *self._sockets)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue  # closed: the loop ends
            try:
                broker = socket.create_connection(self.broker)
            except OSError:
                _close(client)  # the broker is down: the client's connection ends at once, as a refused one
                continue
            self._sockets += [client, broker]
            threading.Thread(target=self._requests, args=(client, broker), daemon=True).start()
            threading.Thread(target=self._pipe, args=(broker, client), daemon=True).start()

    def _requests(self, client: socket.socket, broker: socket.socket) -> None:
        """Client to broker, one request at a time: a size, then the request, whose api key leads."""
        try:
            while True:
                size = _read(client, 4)
                request = _read(client, struct.unpack(">i", size)[0])
                (api_key,) = struct.unpack(">h", request[:2])
                if api_key in self._drop:
                    self.dropped[api_key] += 1
                    continue
                broker.sendall(size + request)
        except OSError:
            _close(client, broker)

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                target.sendall(chunk)
        except OSError:
            pass
        _close(source, target)


def _read(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("closed")
        data += chunk
    return bytes(data)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.close()
