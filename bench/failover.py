"""Failover on a 3-node Apache Kafka: each of issue 42's broker faults while records fall due, counted per record.

Usage: .venv/bin/python -m bench.failover [--rate 300] [--repeat 2] [--faults inbound-leader,...]
                                          [--guarantees exactly-once,at-least-once] [--hold-s 3]

One cluster of three KRaft nodes (broker and controller each) serves the whole run; before each
trial every node runs again and every partition has its full ISR. A trial starts a sidecar process
of its own (its own group, state dir, inbound topic of 3 partitions with 3 replicas and
min.insync.replicas 2), produces delayed records at a steady rate (deliver-at 0.5-3 s ahead), strikes
one fault a few seconds in, keeps producing until the fault is over, and counts, per subscription,
every record two ways: a fresh read_committed read from offset 0 to the high watermark, and a
read_committed reader that kept reading through the fault. Against the inbound topic's records (each
must go out once): lost, duplicated (copies beyond the first), early, the largest lateness as the
live reader saw it, the longest gap in deliveries from the fault on and when deliveries came back
after the fault's end.

The faults (FAULTS), each a function of `Stage` shared with the suite's short version
(tests/failover/test_failover.py):
- inbound-leader: kill -9 of the leader of inbound partition 0; it starts again once another leads.
- outbound-leader: the same for a partition of the first outbound topic whose leader is not the
  group's coordinator (that node's loss past the session timeout is the pause's fault).
- coordinator: kill -9 of the node leading the __transaction_state partition of the sidecar's
  transactional.id (at least once, which has none: of the group's offsets partition's leader).
- pause: SIGSTOP of the group coordinator's node until the controller fences it (its
  broker.session.timeout.ms passed), then SIGCONT.
- majority: kill -9 of two nodes; they start again once /healthz said 503 and 10 s have passed.
- rolling: a controlled stop and start of each node in turn, each waiting for full ISRs.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from bench.probe import LiveReader
from bench.procs import Child
from bench.report import command_line, dated_lines
from sidecar.broker.apache import ApacheKafka
from sidecar.broker.ports import free_port, free_ports
from sidecar.outbound.records import read_delivery

NODES = 3
PARTITIONS = 3
SUBSCRIPTIONS = ("a", "o")
"""A shared and an exclusive subscription: one outbound topic each."""
TRANSACTION_STATE = "__transaction_state"
CONSUMER_OFFSETS = "__consumer_offsets"
MAJORITY_AWAY_S = 10.0
"""Issue 42: the majority stays lost for 10 s or more."""
DEADLINE_S = 180.0
"""Every wait on the cluster or the sidecar: generous, so that only what never happens fails."""
T = TypeVar("T")
FAULTS = ("inbound-leader", "outbound-leader", "coordinator", "pause", "majority", "rolling")
GUARANTEES = ("exactly-once", "at-least-once")
_TRANSACTIONAL_ID = re.compile(r"transactional producer\"? transactional_id=(\S+)")
_QUIET = logging.getLogger("bench.failover.clients")
_QUIET.setLevel(logging.CRITICAL)  # the outages are on purpose: the clients' complaints are expected


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S, every_s: float = 0.2) -> None:
    """Poll `condition` until it holds; RuntimeError naming `what` at the deadline. An exception
    from the condition (a client asking a cluster in the middle of a fault) counts as not yet."""
    deadline = time.monotonic() + timeout_s
    error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception as e:  # the clients raise KafkaException or time out while nodes move
            error = e
        time.sleep(every_s)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {error})")


def answered(ask: Callable[[], T], what: str, timeout_s: float = DEADLINE_S) -> T:
    """`ask`'s answer, asked again while the cluster does not give one. Beside a busy neighbour a
    node's controller once stalled for 26 s and more and fenced its own broker, and a strike that
    asked once, with a 30 s timeout, failed the test before its fault began."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ask()
        except Exception as e:  # KafkaException, or a topic without its partitions yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"no answer in {timeout_s:.0f} s about {what}: {e}") from e
        time.sleep(0.5)


# --- the cluster, as the faults see it -------------------------------------------------------------


def admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}, logger=_QUIET)


def leader_of(bootstrap: str, topic: str, partition: int) -> int:
    """The node id that leads `topic`'s `partition` now (-1 while none does). Node ids are
    ApacheKafka's node numbers (1..N), so the id is also the node to kill."""
    metadata = admin(bootstrap).list_topics(topic, timeout=10).topics[topic]
    if metadata.error is not None:
        raise RuntimeError(f"{topic}: {metadata.error}")
    return int(metadata.partitions[partition].leader)


def java_string_hash(text: str) -> int:
    """Java's String.hashCode, a signed 32-bit int, over UTF-16 code units as Java stores them."""
    h = 0
    data = text.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + int.from_bytes(data[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def kafka_abs(n: int) -> int:
    """org.apache.kafka.common.utils.Utils.abs: Integer.MIN_VALUE maps to 0, not to itself."""
    return 0 if n == -(1 << 31) else abs(n)


def coordinator_partition(key: str, partitions: int) -> int:
    """The partition of __transaction_state (transactional.id) or __consumer_offsets (group id)
    that holds `key`: Kafka's partitionFor, Utils.abs(key.hashCode()) % partitions."""
    return kafka_abs(java_string_hash(key)) % partitions


def partition_count(bootstrap: str, topic: str) -> int:
    """Partitions of an internal topic as the cluster made them: transaction.state.log.num.partitions
    and offsets.topic.num.partitions are the brokers' defaults (50) unless apache.py set them, so
    the count is read from the topic itself rather than assumed."""
    metadata = admin(bootstrap).list_topics(topic, timeout=10).topics[topic]
    if metadata.error is not None or not metadata.partitions:
        raise RuntimeError(f"{topic} is not there yet ({metadata.error})")
    return len(metadata.partitions)


def transaction_coordinator(bootstrap: str, transactional_id: str) -> tuple[int, int]:
    """(node id, __transaction_state partition) of the coordinator of `transactional_id`."""
    partition = coordinator_partition(transactional_id, partition_count(bootstrap, TRANSACTION_STATE))
    return leader_of(bootstrap, TRANSACTION_STATE, partition), partition


def group_coordinator(bootstrap: str, group: str) -> int:
    """The node that coordinates `group`, as the group's description names it."""
    client = admin(bootstrap)  # kept referenced: a client destroyed under its future fails it
    described = client.describe_consumer_groups([group], request_timeout=10)[group].result(30)
    return int(described.coordinator.id)


def session_timeout_ms(bootstrap: str, node: int) -> int:
    """broker.session.timeout.ms of `node`: how long the controller waits for its heartbeats
    before fencing it. apache.py leaves Kafka's default (9 s); read, not assumed."""
    client = admin(bootstrap)
    resource = ConfigResource("broker", str(node))
    described = client.describe_configs([resource], request_timeout=10)[resource].result(30)
    return int(described["broker.session.timeout.ms"].value)


def registered(bootstrap: str) -> set[int]:
    """Nodes the cluster's metadata lists as brokers: a fenced (paused, dead) node is left out."""
    return set(admin(bootstrap).list_topics(timeout=5).brokers)


def fully_replicated(bootstrap: str) -> bool:
    """Every partition of every topic, internal ones included, has a leader and its whole ISR."""
    topics = admin(bootstrap).list_topics(timeout=10).topics
    return all(
        t.error is None and all(p.leader >= 0 and len(p.isrs) == len(p.replicas) for p in t.partitions.values())
        for t in topics.values()
    )


def starts(cluster: ApacheKafka, node: int) -> int:
    """How many times `node`'s log says it started. Without a quorum the metadata is frozen (it
    still lists the dead nodes as brokers), so a node's return is read from its own log."""
    try:
        return (cluster.node(node).directory / "server.log").read_text(errors="replace").count("Kafka Server started")
    except OSError:
        return 0


def restore(cluster: ApacheKafka) -> None:
    """Every node running, registered and in every ISR: the state each trial starts from."""
    for node in cluster.nodes:
        cluster.resume_node(node.node_id)  # harmless on a running node; a paused one could not answer
        if not node.running:
            cluster.start_node(node.node_id, wait=False)
    cluster.wait_ready()
    wait_until(lambda: fully_replicated(cluster.bootstrap_servers), "every partition fully replicated")


def create_inbound(bootstrap: str, topic: str) -> None:
    """Replicated as issue 42 asks of inbound topics the user creates: 3 replicas, 2 in sync to write."""
    client = admin(bootstrap)
    new = NewTopic(topic, PARTITIONS, replication_factor=NODES, config={"min.insync.replicas": "2"})
    client.create_topics([new])[topic].result(30)
    wait_until(lambda: all(leader_of(bootstrap, topic, p) > 0 for p in range(PARTITIONS)), f"leaders of {topic}")


def health(port: int) -> tuple[int, dict[str, object]]:
    """/healthz: (status code, body); (0, {}) while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


# --- the load, the sidecar and what a fault acts on -------------------------------------------------


class Load:
    """Delayed records at a steady rate from a thread, each due 0.5-3 s after it is produced, until
    stopped; acks=all. The inbound topic itself is the list of what must go out: idempotent, it
    holds each record once however the leaders move; not (`idempotent=False`), a retried record can
    be there twice, at two offsets, and each must go out once.

    The suite's tests are not idempotent: an idempotent producer's broker thread spins at a full core
    while a replica stalls (docs/operations/faults.md), and took 120 s of the two cores' CPU from the
    failover tests (2026-11-29, `3add293`)."""

    def __init__(self, bootstrap: str, topic: str, rate: float, idempotent: bool = True) -> None:
        self._producer = Producer(
            {"bootstrap.servers": bootstrap, "enable.idempotence": idempotent, "acks": "all", "linger.ms": 5},
            logger=_QUIET,
        )
        self._topic, self._rate = topic, rate
        self._stop = threading.Event()
        self.sent = 0
        self.acked = 0
        self.failed: list[str] = []
        self._thread = threading.Thread(target=self._run, name="failover-load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def _report(self, error: KafkaError | None, _: Message) -> None:
        if error is None:
            self.acked += 1
        else:
            self.failed.append(str(error))

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            due = int((time.monotonic() - started) * self._rate)
            while self.sent < due:
                deliver_at = now_ms() + random.randint(500, 3_000)
                try:
                    self._producer.produce(
                        self._topic, f"v{self.sent}".encode(), partition=self.sent % PARTITIONS,
                        headers=[("deliver-at", str(deliver_at))], on_delivery=self._report,
                    )  # fmt: skip
                except BufferError:
                    break
                self.sent += 1
            self._producer.poll(0.02)

    def close(self) -> None:
        """Stop producing; what is still queued is dropped (a test that failed)."""
        self._stop.set()
        self._thread.join()
        self._producer.purge()

    def stop(self) -> int:
        """Stop producing and wait until every record has its delivery report (the cluster may still
        be recovering); the count acknowledged. A report can be an error for a record that was written
        all the same (its acknowledgement lost in a roll), so the inbound topic, not this count, says
        what must go out: it holds at least the acknowledged records and at most the sent ones."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + DEADLINE_S
        while self._producer.flush(5) and time.monotonic() < deadline:
            pass
        if self.acked + len(self.failed) != self.sent:
            raise RuntimeError(f"{self.sent - self.acked - len(self.failed)} of {self.sent} records have no report")
        return self.acked


@dataclass
class Stage:
    """What a fault acts on, and what it may ask of the trial."""

    cluster: ApacheKafka
    inbound: str
    outbound: list[str]
    group: str
    sidecar_log: Path
    health_port: int
    guarantee: str
    hold_s: float = 3.0
    """How long a killed node stays down after another node leads its partition."""
    delivered: Callable[[], int] = lambda: 0
    """Records the live reader has seen so far: the majority fault checks that none come while it is away."""

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap_servers


@dataclass
class Struck:
    """One fault as it happened: its nodes, when it struck and when it was over (ms since the epoch)."""

    fault: str
    nodes: list[int]
    began_ms: int
    ended_ms: int = 0
    detail: str = ""
    facts: dict[str, object] = field(default_factory=dict)
    """What the fault observed that a test asserts on (the majority's /healthz, deliveries while away)."""


def transactional_id(log: Path) -> str:
    """The sidecar's current transactional.id: the last one its writer logged (a new one per engine start)."""
    found = _TRANSACTIONAL_ID.findall(log.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"{log} names no transactional.id: is the sidecar in exactly-once mode, at INFO?")
    return str(found[-1])


def _kill_until_led_elsewhere(stage: Stage, struck: Struck, topic: str, partition: int) -> Struck:
    """kill -9 of `topic`/`partition`'s leader; it starts again `hold_s` after another node leads."""
    node = struck.nodes[0]
    stage.cluster.kill_node(node)
    wait_until(lambda: leader_of(stage.bootstrap, topic, partition) not in (node, -1), f"a new leader of {topic}")
    struck.facts["new_leader"] = leader_of(stage.bootstrap, topic, partition)
    time.sleep(stage.hold_s)
    stage.cluster.start_node(node)
    struck.ended_ms = now_ms()
    return struck


def inbound_leader(stage: Stage) -> Struck:
    node = answered(lambda: leader_of(stage.bootstrap, stage.inbound, 0), f"the leader of {stage.inbound}/0")
    struck = Struck("inbound-leader", [node], now_ms(), detail=f"node {node} led {stage.inbound}/0")
    return _kill_until_led_elsewhere(stage, struck, stage.inbound, 0)


def outbound_leader(stage: Stage) -> Struck:
    """An outbound leader's loss alone. Its node may also coordinate the sidecar's group: away past
    --session-timeout-ms (a loaded machine's failover took longer), the member rejoins, is fenced by
    its own new member id and starts its engine again, /healthz 503 meanwhile, as in the pause."""
    topic = stage.outbound[0]
    avoid = answered(lambda: group_coordinator(stage.bootstrap, stage.group), f"the coordinator of {stage.group}")
    leaders = answered(
        lambda: [leader_of(stage.bootstrap, topic, p) for p in range(partition_count(stage.bootstrap, topic))],
        f"the leaders of {topic}",
    )
    partition = next((p for p, node in enumerate(leaders) if node != avoid), 0)
    node = leaders[partition]
    struck = Struck("outbound-leader", [node], now_ms(), detail=f"node {node} led {topic}/{partition}")
    struck.facts["group_coordinator"] = avoid
    return _kill_until_led_elsewhere(stage, struck, topic, partition)


def coordinator(stage: Stage) -> Struck:
    """The transaction coordinator of the id the sidecar writes with now. At least once has no
    transactional.id: the group's coordinator is struck instead, where the group's offsets live."""
    if stage.guarantee == "exactly-once":
        tid = transactional_id(stage.sidecar_log)
        node, partition = answered(lambda: transaction_coordinator(stage.bootstrap, tid), f"the coordinator of {tid}")
        struck = Struck("coordinator", [node], now_ms(), detail=f"node {node} led {TRANSACTION_STATE}-{partition}")
        struck.facts.update(transactional_id=tid, partition=partition)
        return _kill_until_led_elsewhere(stage, struck, TRANSACTION_STATE, partition)
    partition = coordinator_partition(
        stage.group, answered(lambda: partition_count(stage.bootstrap, CONSUMER_OFFSETS), CONSUMER_OFFSETS)
    )
    node = answered(
        lambda: leader_of(stage.bootstrap, CONSUMER_OFFSETS, partition), f"the leader of {CONSUMER_OFFSETS}-{partition}"
    )
    struck = Struck("coordinator", [node], now_ms(), detail=f"node {node} led {CONSUMER_OFFSETS}-{partition}")
    return _kill_until_led_elsewhere(stage, struck, CONSUMER_OFFSETS, partition)


def pause(stage: Stage) -> Struck:
    """SIGSTOP of the group coordinator's node until the controller has fenced it: it left the
    cluster's metadata, so its broker.session.timeout.ms passed without a heartbeat."""
    node = answered(lambda: group_coordinator(stage.bootstrap, stage.group), f"the coordinator of {stage.group}")
    session_ms = answered(lambda: session_timeout_ms(stage.bootstrap, node), f"node {node}'s session timeout")
    struck = Struck("pause", [node], now_ms(), detail=f"node {node} coordinated {stage.group}")
    stage.cluster.pause_node(node)
    try:
        wait_until(lambda: node not in registered(stage.bootstrap), f"node {node} fenced", every_s=0.5)
        struck.facts["fenced_after_s"] = (now_ms() - struck.began_ms) / 1000
        struck.facts["session_timeout_ms"] = session_ms
        time.sleep(stage.hold_s)
    finally:
        stage.cluster.resume_node(node)
    stage.cluster.wait_ready()
    struck.ended_ms = now_ms()
    return struck


def majority(stage: Stage) -> Struck:
    """kill -9 of two of the three nodes. They stay down until /healthz said 503 and at least
    MAJORITY_AWAY_S passed; the live reader's count then and just before they come back are kept,
    and so is every /healthz answer seen."""
    nodes = [1, 2]
    struck = Struck("majority", nodes, now_ms(), detail=f"nodes {nodes} killed; node 3 alone")
    for node in nodes:
        stage.cluster.kill_node(node)
    answers: list[int] = []

    def unhealthy() -> bool:
        answers.append(health(stage.health_port)[0])
        return answers[-1] == 503

    wait_until(unhealthy, "/healthz to answer 503 while the majority is lost", every_s=0.5)
    struck.facts["503_after_s"] = (now_ms() - struck.began_ms) / 1000
    struck.facts["delivered_at_503"] = stage.delivered()
    wait_until(lambda: now_ms() - struck.began_ms >= MAJORITY_AWAY_S * 1000, "the majority away 10 s")
    struck.facts["healthz_before_back"] = health(stage.health_port)[0]
    struck.facts["delivered_before_back"] = stage.delivered()
    struck.facts["away_s"] = (now_ms() - struck.began_ms) / 1000
    before = {node: starts(stage.cluster, node) for node in nodes}
    for node in nodes:
        stage.cluster.start_node(node, wait=False)
    wait_until(lambda: all(starts(stage.cluster, n) > before[n] for n in nodes), f"nodes {nodes} started again")
    stage.cluster.wait_ready()
    struck.ended_ms = now_ms()
    return struck


def rolling(stage: Stage) -> Struck:
    """Each node in turn: a controlled stop, a start, and full ISRs before the next, as an operator
    rolls a cluster."""
    struck = Struck("rolling", [n.node_id for n in stage.cluster.nodes], now_ms(), detail="nodes 1, 2, 3 in turn")
    for node in stage.cluster.nodes:
        stage.cluster.stop_node(node.node_id)
        stage.cluster.start_node(node.node_id)
        wait_until(lambda: fully_replicated(stage.bootstrap), f"full ISRs after node {node.node_id}")
    struck.ended_ms = now_ms()
    return struck


STRIKES: dict[str, Callable[[Stage], Struck]] = {
    "inbound-leader": inbound_leader,
    "outbound-leader": outbound_leader,
    "coordinator": coordinator,
    "pause": pause,
    "majority": majority,
    "rolling": rolling,
}


class Sidecar:
    """`delay-sidecar run` as a process on the cluster, at INFO (the transactional.id is read from its log)."""

    def __init__(self, stage: Stage, policies: Path, state_dir: Path) -> None:
        argv = [sys.executable, "-m", "sidecar", "run", "--bootstrap-servers", stage.bootstrap,
                "--policies", str(policies), "--state-dir", str(state_dir), "--metrics-port", str(stage.health_port),
                "--group-id", stage.group, "--commit-interval-ms", "200",
                "--processing-guarantee", stage.guarantee]  # fmt: skip
        self.child = Child(argv, stage.sidecar_log)
        self.port = stage.health_port

    def wait_ready(self) -> None:
        def ready() -> bool:
            if not self.child.alive():
                raise SystemExit(f"the sidecar exited with {self.child.process.returncode}:\n{self.child.tail()}")
            return health(self.port)[0] == 200

        wait_until(ready, "the sidecar ready")

    def stop(self) -> int:
        return self.child.stop()


def new_stage(cluster: ApacheKafka, work: Path, guarantee: str, hold_s: float = 3.0) -> tuple[Stage, Path]:
    """A stage for one trial: a fresh inbound topic, group and port; the policies file to serve it."""
    name = f"failover-{uuid.uuid4().hex[:8]}"
    create_inbound(cluster.bootstrap_servers, name)
    policies = work / f"{name}.yaml"
    policies.write_text(f"topics:\n  {name}:\n    subscriptions: {{a: {{}}, o: {{type: exclusive}}}}\n")
    stage = Stage(cluster, name, [f"{name}.{s}" for s in SUBSCRIPTIONS], name, work / f"{name}.log", free_port(),
                  guarantee, hold_s)  # fmt: skip
    return stage, policies


# --- the bench: counting ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One outbound record: its origin and deliver-at, its timestamp, and when a reader got it (ms)."""

    topic: str
    origin: tuple[int, int, int]
    """(inbound partition, inbound offset, redelivery count)."""
    deliver_at: int
    timestamp: int
    received_ms: int


def _seen(m: Message) -> Seen:
    d = read_delivery(dict(m.headers() or []))
    return Seen(m.topic(), (d.partition, d.offset, d.redelivery_count), d.deliver_at, m.timestamp()[1], now_ms())


def inbound_origins(bootstrap: str, topic: str) -> set[tuple[int, int, int]]:
    """Every record of the inbound topic, as the origin its delivery must carry."""
    return {(s.origin[0], s.origin[1], 0) for s in _read(bootstrap, topic, "read_uncommitted", inbound=True)}


def fresh_read(bootstrap: str, topic: str) -> list[Seen]:
    """A new read_committed consumer from offset 0 to each partition's high watermark now."""
    return _read(bootstrap, topic, "read_committed")


def _end(consumer: Consumer, partition: TopicPartition) -> int:
    """The high watermark, asked again while the partition's leader moves (stale metadata just after
    a fault answers NOT_LEADER_FOR_PARTITION)."""
    return answered(
        lambda: int(consumer.get_watermark_offsets(partition, timeout=10, cached=False)[1]),
        f"the end of {partition.topic}/{partition.partition}",
    )


def _read(bootstrap: str, topic: str, isolation: str, inbound: bool = False) -> list[Seen]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"failover-read-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "enable.partition.eof": True,
                         "isolation.level": isolation}, logger=_QUIET)  # fmt: skip
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: _end(consumer, TopicPartition(topic, p)) for p in partitions}
        ends = {p: end for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        out: list[Seen] = []
        deadline = time.monotonic() + DEADLINE_S
        while ends and time.monotonic() < deadline:
            for m in consumer.consume(10_000, 0.5):
                if m.error() is None and m.offset() < ends.get(m.partition(), -1):
                    if inbound:
                        out.append(Seen(topic, (m.partition(), m.offset(), 0), 0, 0, 0))
                    else:
                        out.append(_seen(m))
                if m.partition() in ends and m.offset() >= ends[m.partition()] - 1:
                    del ends[m.partition()]
        if ends:
            raise RuntimeError(f"{topic}: partitions {sorted(ends)} not read to their end")
        return out
    finally:
        consumer.close()


@dataclass
class Tally:
    """One reader's count of one outbound topic against the inbound records."""

    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    early: int = 0
    strays: int = 0
    """Records with an origin the inbound topic does not hold: counted apart, never as delivered."""


def tally(expected: set[tuple[int, int, int]], records: list[Seen]) -> Tally:
    copies = Counter(r.origin for r in records)
    return Tally(
        delivered=len(expected & copies.keys()),
        lost=len(expected - copies.keys()),
        duplicated=sum(n - 1 for origin, n in copies.items() if origin in expected),
        early=sum(1 for r in records if r.timestamp < r.deliver_at),
        strays=sum(n for origin, n in copies.items() if origin not in expected),
    )


@dataclass
class Trial:
    """One fault on one sidecar: what was struck, and both readers' counts per outbound topic."""

    struck: Struck
    produced: int
    fresh: dict[str, Tally]
    live: dict[str, Tally]
    max_lateness_s: float
    stall_s: float
    """The longest gap between two deliveries the live reader saw, from the fault's start on."""
    resumed_s: float | None
    """From the fault's end to the first delivery after it; None when everything was out before."""
    healthz: Counter[int]


def run_trial(cluster: ApacheKafka, work: Path, fault: str, guarantee: str, rate: float, hold_s: float) -> Trial:
    """One trial of the bench: sidecar, load, the fault, then both readers' counts."""
    restore(cluster)
    stage, policies = new_stage(cluster, work, guarantee, hold_s)
    sidecar = Sidecar(stage, policies, work / f"{stage.inbound}-state")
    seen: list[Seen] = []
    lock = threading.Lock()

    def take(m: Message) -> None:
        with lock:
            seen.append(_seen(m))

    healthz: Counter[int] = Counter()
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            healthz[health(stage.health_port)[0]] += 1
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        sidecar.wait_ready()
        live = LiveReader(stage.bootstrap, stage.outbound, PARTITIONS, take)
        stage.delivered = lambda: len(seen)
        load = Load(stage.bootstrap, stage.inbound, rate).start()
        sampler.start()
        time.sleep(3)  # records in flight and falling due when the fault strikes
        struck = STRIKES[fault](stage)
        time.sleep(2)  # records produced after the fault too
        produced = load.stop()
        expected = inbound_origins(stage.bootstrap, stage.inbound)
        if not produced <= len(expected) <= load.sent:
            raise RuntimeError(
                f"{stage.inbound} holds {len(expected)} records: {produced} acknowledged, {load.sent} sent"
            )

        def all_seen() -> bool:
            with lock:
                return all(expected <= {s.origin for s in seen if s.topic == t} for t in stage.outbound)

        try:
            wait_until(all_seen, "every record seen by the live reader", every_s=1.0)
        except RuntimeError as e:
            print(f"[failover] {fault}/{guarantee}: {e}", file=sys.stderr, flush=True)
        sidecar.stop()
        if not live.finish(DEADLINE_S):
            print(f"[failover] {fault}/{guarantee}: the live reader did not catch up", file=sys.stderr, flush=True)
        fresh = {t: tally(expected, fresh_read(stage.bootstrap, t)) for t in stage.outbound}
    finally:
        sampling.set()
        sidecar.stop()
    with lock:
        by_topic = {t: [s for s in seen if s.topic == t] for t in stage.outbound}
        receipts = sorted(s.received_ms for s in seen)
        lateness = max((s.received_ms - s.deliver_at for s in seen), default=0)
    after = [t for t in receipts if t >= struck.began_ms]
    gaps = [b - a for a, b in zip([struck.began_ms, *after], after, strict=False)]
    resumed = next((t for t in receipts if t >= struck.ended_ms), None)
    return Trial(
        struck,
        produced,
        fresh,
        {t: tally(expected, records) for t, records in by_topic.items()},
        lateness / 1000,
        max(gaps, default=0) / 1000,
        None if resumed is None else (resumed - struck.ended_ms) / 1000,
        healthz,
    )


# --- the bench: the table ----------------------------------------------------------------------------


def rows(fault: str, trials: dict[str, list[Trial]]) -> list[str]:
    """The table of one fault: a row per guarantee, summed over its runs and its outbound topics."""
    lines = [
        f"#### {fault}",
        "",
        "| guarantee | runs | produced | delivered (fresh) | lost | duplicated | early | live reader lost / dup "
        "/ early | max lateness s | longest stall s (max) | resumed after the fault's end s (max) "
        "| /healthz 503 samples | struck |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for guarantee, done in trials.items():
        if not done:
            continue
        fresh = [t for trial in done for t in trial.fresh.values()]
        live = [t for trial in done for t in trial.live.values()]
        resumed = [t.resumed_s for t in done if t.resumed_s is not None]
        cells = [
            guarantee,
            str(len(done)),
            f"{sum(t.produced for t in done):,}",
            f"{sum(t.delivered for t in fresh):,}",
            str(sum(t.lost for t in fresh)),
            str(sum(t.duplicated for t in fresh)),
            str(sum(t.early for t in fresh)),
            f"{sum(t.lost for t in live)} / {sum(t.duplicated for t in live)} / {sum(t.early for t in live)}",
            f"{max(t.max_lateness_s for t in done):.1f}",
            f"{max(t.stall_s for t in done):.1f}",
            f"{max(resumed):.1f}" if resumed else "-",
            str(sum(t.healthz[503] for t in done)),
            "; ".join(t.struck.detail for t in done),
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=300, metavar="N", help="records produced per second")
    parser.add_argument("--repeat", type=int, default=2, metavar="N", help="trials of each fault and guarantee")
    parser.add_argument("--faults", default=",".join(FAULTS), metavar="LIST", help=",".join(FAULTS))
    parser.add_argument("--guarantees", default=",".join(GUARANTEES), metavar="LIST", help=",".join(GUARANTEES))
    parser.add_argument("--hold-s", type=float, default=3.0, metavar="S",
                        help="how long a killed or paused node stays away once the cluster has moved on")  # fmt: skip
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    guarantees = [g for g in args.guarantees.split(",") if g]
    unknown = (set(faults) - set(FAULTS)) | (set(guarantees) - set(GUARANTEES))
    if unknown:
        parser.error(f"unknown {sorted(unknown)}: faults are {','.join(FAULTS)}; guarantees {','.join(GUARANTEES)}")
    results: dict[str, dict[str, list[Trial]]] = {f: {g: [] for g in guarantees} for f in faults}
    failures: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as work:
        cluster = ApacheKafka(Path(work) / "kafka", port=free_ports(2 * NODES), nodes=NODES)
        with cluster:
            dated = dated_lines(
                cluster,
                command_line("bench", ["failover", *(sys.argv[1:] if argv is None else argv)]),
                "one cluster for every trial",
            )
            for fault in faults:
                for guarantee in guarantees:
                    for i in range(args.repeat):
                        try:
                            trial = run_trial(cluster, Path(work), fault, guarantee, args.rate, args.hold_s)
                        except (Exception, SystemExit) as e:  # a trial that never finished: named, not counted
                            failures.append(f"{fault} {guarantee} run {i + 1}: {e}"[:2000])
                            print(f"[failover] {failures[-1]}", file=sys.stderr, flush=True)
                            continue
                        results[fault][guarantee].append(trial)
                        fresh = [t for t in trial.fresh.values()]
                        print(f"[failover] {fault} {guarantee} run {i + 1}: produced={trial.produced} "
                              f"lost={sum(t.lost for t in fresh)} duplicated={sum(t.duplicated for t in fresh)} "
                              f"early={sum(t.early for t in fresh)} stall_s={trial.stall_s:.1f} "
                              f"{trial.struck.detail} {trial.struck.facts}", file=sys.stderr, flush=True)  # fmt: skip
    print(dated)
    print(f"- duration: {time.monotonic() - started:.0f} s; {args.rate:.0f} records/s, due 0.5-3 s after produced")
    print()
    for fault in faults:
        print("\n".join(rows(fault, results[fault])))
        print()
    lost = sum(t.lost for f in results.values() for g in f.values() for tr in g for t in tr.fresh.values())
    once = [tr for f in results.values() for tr in f.get("exactly-once", [])]
    dup = sum(t.duplicated + t.early for tr in once for t in [*tr.fresh.values(), *tr.live.values()])
    for failure in failures:
        print(f"- not counted: {failure}")
    return 0 if lost == 0 and dup == 0 and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
