"""A static member's planned exit: LeaveGroup for its group.instance.id, after a clean stop.

A static member (group.instance.id) never sends LeaveGroup when it closes (KIP-345): the group
keeps its partitions for it until it comes back, or, on Kafka, until session.timeout.ms passes.
Both brokers need the planned leave. On Apache Kafka 4.1.1 the other member of a group of two got
a closed static member's partitions 13.0 s after the close (session.timeout.ms 15,000, the default then; 4.2 s after
a kill with 6,000), against 1.0 s when the closed member left with this: without it, a sidecar
scaled down leaves its partitions undelivered for the session timeout. The fallback broker,
noida-db, never expires a member at all: 40 s after the close the other member still had 2 of 4
partitions, against 1.0 s with this.

librdkafka has no call that removes a static member, so this sends the request Kafka's
AdminClient.removeMembersFromConsumerGroup sends: LeaveGroup v3 naming the instance id, to the
group coordinator. It speaks the Kafka protocol over a plain TCP connection, so it is only used
with PLAINTEXT listeners; on a secured cluster the sidecar joins as a dynamic member instead, and
librdkafka's own close sends LeaveGroup (see app.py).
"""

import logging
import socket
import struct
import time

from sidecar.errors import BrokerError

logger = logging.getLogger(__name__)

API_FIND_COORDINATOR = 10
API_LEAVE_GROUP = 13
NONE = 0
# Already gone, or the group is: nothing to hand over.
GONE = {25, 69}  # UNKNOWN_MEMBER_ID, GROUP_ID_NOT_FOUND
# Transient while the coordinator moves or loads the group: ask again.
RETRIABLE = {14, 15, 16}  # COORDINATOR_LOAD_IN_PROGRESS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR
CLIENT_ID = "delay-sidecar-leave"
TIMEOUT_S = 10.0


def _string(value: str | None) -> bytes:
    if value is None:
        return struct.pack(">h", -1)
    data = value.encode()
    return struct.pack(">h", len(data)) + data


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str | None:
        size = self.take(">h")
        if size < 0:
            return None
        value = self.data[self.at : self.at + size].decode()
        self.at += size
        return value


def _address(server: str) -> tuple[str, int]:
    host, _, port = server.strip().rpartition("://")[2].rpartition(":")
    return host.strip("[]"), int(port)


def _call(address: tuple[str, int], api_key: int, version: int, body: bytes) -> _Reader:
    """One request, one response, on a connection of its own: this runs once, at exit."""
    request = struct.pack(">hhi", api_key, version, 1) + _string(CLIENT_ID) + body
    with socket.create_connection(address, timeout=TIMEOUT_S) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        size = struct.unpack(">i", _receive(sock, 4))[0]
        reader = _Reader(_receive(sock, size))
    reader.take(">i")  # correlation id
    return reader


def _receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("connection closed by the broker")
        data += chunk
    return data


def _coordinator(bootstrap_servers: str, group_id: str) -> tuple[str, int]:
    last: Exception | None = None
    for server in bootstrap_servers.split(","):
        try:
            reader = _call(_address(server), API_FIND_COORDINATOR, 1, _string(group_id) + struct.pack(">b", 0))
        except (OSError, ValueError, struct.error) as e:
            last = e
            continue
        reader.take(">i")  # throttle
        error = reader.take(">h")
        message = reader.string()
        reader.take(">i")  # node id
        host, port = reader.string(), reader.take(">i")
        if error != NONE or host is None:
            raise _Retry(f"FindCoordinator error {error} ({message})")
        return host, port
    raise _Retry(f"no bootstrap server answered ({last})")


class _Retry(Exception):
    pass


def leave_group(bootstrap_servers: str, group_id: str, instance_id: str, timeout_s: float = 30.0) -> None:
    """Remove the static member `instance_id` from the group, so its partitions move now.

    Call it only after the consumer has closed: its last checkpoint is committed, and a member that
    is still polling would join again at once.
    """
    deadline = time.monotonic() + timeout_s
    body = _string(group_id) + struct.pack(">i", 1) + _string("") + _string(instance_id)
    problem = ""
    while True:
        try:
            reader = _call(_coordinator(bootstrap_servers, group_id), API_LEAVE_GROUP, 3, body)
            reader.take(">i")  # throttle
            error = reader.take(">h")
            members = reader.take(">i")
            member_errors = []
            for _ in range(max(members, 0)):
                reader.string()
                reader.string()
                member_errors.append(reader.take(">h"))
            error = error or next((e for e in member_errors if e != NONE), NONE)
            if error == NONE:
                logger.info("left the consumer group group=%s instance_id=%s", group_id, instance_id)
                return
            if error in GONE:
                logger.info("not in the consumer group group=%s instance_id=%s error=%d", group_id, instance_id, error)
                return
            if error not in RETRIABLE:
                raise BrokerError(
                    f"LeaveGroup for instance {instance_id} in group {group_id} failed with Kafka error {error}; "
                    f"its partitions stay with it until it comes back (or, on Kafka, until session.timeout.ms)"
                )
            problem = f"Kafka error {error}"
        except (_Retry, OSError, struct.error) as e:
            problem = str(e)
        if time.monotonic() > deadline:
            raise BrokerError(
                f"LeaveGroup for instance {instance_id} in group {group_id} got no answer in {timeout_s:.0f} s "
                f"({problem}); its partitions stay with it until it comes back (or, on Kafka, until "
                f"session.timeout.ms). Check that the brokers are reachable"
            )
        time.sleep(0.5)
