"""Apache Kafka itself, as child processes: N nodes in KRaft combined mode (each a broker and a controller).

It is started as the release's scripts start it: the storage tool formats each node's log dir
once, then `kafka.Kafka` runs with a properties file, with the release's JVM settings. The jars
come from Maven Central (jars.py), fetched once.

The rules the embedded broker keeps hold here too:
- No JVM outlives its parent: the kernel sends SIGKILL when the thread that started it ends. Kafka
  is built to survive a crash (its log is recovered at the next start), so a hard stop loses
  nothing that was acknowledged; a controlled stop (SIGTERM) is what `stop` does.
- A data dir is ours only if we formatted it: one holding anything else, or formatted for another
  cluster, is an error and nothing is deleted.
- A port in use is not an error: the nodes move to free ports, and the log says which.

Node i (from 1) listens for clients on `port + i - 1` and for its controller peers on
`port + N + i - 1`; its data, properties and log are under `<data-dir>/node-<i>`.
"""

import base64
import json
import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from sidecar.broker.base import BrokerLauncher
from sidecar.broker.class_archive import ClassArchive
from sidecar.broker.jars import KAFKA_VERSION, fetch_kafka
from sidecar.broker.lifeline import die_with_parent
from sidecar.broker.ports import free_ports, port_in_use, reserve
from sidecar.errors import BrokerError

logger = logging.getLogger(__name__)

CLUSTER_FILE = "cluster.json"
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 60.0
QUORUMLESS_GRACE_S = 5.0
"""How long a stopping node may take once the controller quorum is gone: enough to finish a shutdown
already granted, where one still waiting for the grant would wait forever."""
NO_QUORUM = "the controller quorum is gone, so it cannot finish a controlled shutdown"
HEAP_ENV = "KAFKA_HEAP_OPTS"
DEFAULT_HEAP = "-Xms256m -Xmx1g"
"""Kafka's scripts give 1 GiB up front; a node here starts at 256 MiB so that a machine of 24 GiB
runs the suite's broker, a 3-node cluster and the benchmarks' side by side."""
JVM_OPTS = (
    # kafka-run-class.sh's KAFKA_JVM_PERFORMANCE_OPTS
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxInlineLevel=15",
    "-Djava.awt.headless=true",
)
LOG_TAIL_LINES = 25
GC_LOG = "kafkaServer-gc.log"

_LOG4J = """\
shutdownHook = disable
appender.server.type = RollingFile
appender.server.name = server
appender.server.fileName = ${sys:kafka.logs.dir}/server.log
appender.server.filePattern = ${sys:kafka.logs.dir}/server.log.%i
appender.server.layout.type = PatternLayout
appender.server.layout.pattern = [%d] %p %m (%c)%n
appender.server.policies.type = Policies
appender.server.policies.size.type = SizeBasedTriggeringPolicy
appender.server.policies.size.size = 50MB
appender.server.strategy.type = DefaultRolloverStrategy
appender.server.strategy.max = 2
rootLogger.level = INFO
rootLogger.appenderRef.server.ref = server
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
"""


def new_cluster_id() -> str:
    """What `kafka-storage.sh random-uuid` prints: 16 random bytes, URL-safe base64, no padding."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka refuses ids that would read as a command-line option
            return text


def replication_for(nodes: int) -> tuple[int, int]:
    """Replication factor and min.insync.replicas that fit a cluster of `nodes`: 3 and 2 on 3 or more."""
    factor = min(3, nodes)
    return factor, max(1, factor - 1)


@dataclass
class Node:
    node_id: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    archive_partial: Path | None = None
    """The class archive this node's JVM writes as it exits, if it is the one writing it."""

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        text = ""
        for name in ("server.log", "console.log"):
            try:
                text += (self.directory / name).read_text(errors="replace")
            except OSError:
                continue
        return "\n".join(text.splitlines()[-lines:])


class ApacheKafka(BrokerLauncher):
    """A cluster of `nodes` Apache Kafka processes under `data_dir`; `bootstrap_servers` names all of them."""

    kind = "Apache Kafka"

    def __init__(
        self,
        data_dir: Path,
        port: int = 9092,
        host: str = "127.0.0.1",
        nodes: int = 1,
        version: str = KAFKA_VERSION,
        settings: Mapping[str, object] | None = None,
    ) -> None:
        """`settings`: server.properties entries over the launcher's own (tests shrink the internal
        topics with them; `delay-sidecar broker` runs with the release's defaults)."""
        if nodes < 1:
            raise BrokerError(f"--nodes must be 1 or more, not {nodes}")
        self.data_dir = data_dir
        self.host = host
        self.version = version
        self.port = port
        self._settings = dict(settings or {})
        self.nodes = [Node(i, data_dir / f"node-{i}") for i in range(1, nodes + 1)]
        self.bootstrap_servers = ""
        self._classpath = ""
        self._archive: ClassArchive | None = None
        self._ports_chosen = False

    @property
    def description(self) -> str:
        size = f"{len(self.nodes)} nodes" if len(self.nodes) > 1 else "1 node"
        return f"Apache Kafka {self.version} ({size}, KRaft)"

    def broker_port(self, node_id: int) -> int:
        return self.port + node_id - 1

    def controller_port(self, node_id: int) -> int:
        return self.port + len(self.nodes) + node_id - 1

    def start(self) -> str:
        """Fetch the jars if needed, format new nodes, start every node and wait until all are brokers."""
        libs = fetch_kafka(self.version)
        self._classpath = str(libs / "*")
        self._archive = ClassArchive(libs.parent)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_running()
        if not self._ports_chosen:  # a restart keeps its ports: its clients know them
            self._pick_ports()
            self._ports_chosen = True
        self.bootstrap_servers = ",".join(f"{self.host}:{self.broker_port(n.node_id)}" for n in self.nodes)
        cluster_id = self._cluster_id()  # before anything is written: a refused data dir stays as it was
        (self.data_dir / "log4j2.properties").write_text(_LOG4J)  # one for every node
        for node in self.nodes:
            self._write_config(node)
        self._format(cluster_id)
        for node in self.nodes:
            self.start_node(node.node_id, wait=False)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info(
            "broker ready kind=apache-kafka version=%s nodes=%d bootstrap=%s",
            self.version,
            len(self.nodes),
            self.bootstrap_servers,
        )
        return self.bootstrap_servers

    def _refuse_running(self) -> None:
        for node in self.nodes:
            try:
                pid = int((node.directory / "pid").read_text())
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if b"kafka.Kafka" in cmdline and str(node.directory).encode() in cmdline:
                raise BrokerError(
                    f"another Apache Kafka process (pid {pid}) serves {node.directory}: another run or broker "
                    f"command on the same data dir. Stop it (kill {pid}), or use another --data-dir / --state-dir"
                )

    def _pick_ports(self) -> None:
        count = 2 * len(self.nodes)
        # Held for as long as we live, so no other process of ours is handed a stopped node's port.
        taken = [p for p in range(self.port, self.port + count) if port_in_use(self.host, p) or not reserve(p)]
        if taken:
            base = free_ports(count)
            logger.warning(
                "broker ports taken (in use, or held by another of our processes); using free ones "
                "taken=%s wanted=%d-%d using=%d-%d",
                taken,
                self.port,
                self.port + count - 1,
                base,
                base + count - 1,
            )
            self.port = base

    def _write_config(self, node: Node) -> None:
        factor, min_isr = replication_for(len(self.nodes))
        voters = ",".join(f"{n.node_id}@{self.host}:{self.controller_port(n.node_id)}" for n in self.nodes)
        bport, cport = self.broker_port(node.node_id), self.controller_port(node.node_id)
        settings = {
            "process.roles": "broker,controller",
            "node.id": node.node_id,
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{self.host}:{bport},CONTROLLER://{self.host}:{cport}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{bport}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": node.directory / "data",
            "num.partitions": 1,
            "default.replication.factor": factor,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": factor,
            "transaction.state.log.replication.factor": factor,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": factor,
            "share.coordinator.state.topic.min.isr": min_isr,
            # As the release's config/server.properties: a group's first member does not wait 3 s.
            "group.initial.rebalance.delay.ms": 0,
            **self._settings,
        }
        node.directory.mkdir(parents=True, exist_ok=True)
        (node.directory / "server.properties").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))

    def _cluster_id(self) -> str:
        """The id this data dir was formatted with, or a new one for a new data dir.

        Refuses a data dir that holds anything we did not write, or whose nodes were formatted for
        another cluster or another number of nodes; it deletes nothing.
        """
        record = self.data_dir / CLUSTER_FILE
        if record.is_file():
            known = json.loads(record.read_text())
            if known.get("nodes") != len(self.nodes):
                raise BrokerError(
                    f"{self.data_dir} holds a cluster of {known.get('nodes')} nodes, not {len(self.nodes)}: start it "
                    f"with --nodes {known.get('nodes')}, or give another --data-dir (nothing was deleted)"
                )
            cluster_id = str(known["cluster_id"])
        else:
            ours = {CLUSTER_FILE, "log4j2.properties", *(n.directory.name for n in self.nodes)}
            strangers = sorted(p.name for p in self.data_dir.iterdir() if p.name not in ours)
            if strangers:
                raise BrokerError(
                    f"{self.data_dir} is not an Apache Kafka data dir of this launcher (it holds {strangers[:3]}): "
                    f"give an empty or new --data-dir; nothing was deleted"
                )
            cluster_id = new_cluster_id()
        for node in self.nodes:
            found = _meta_cluster_id(node.directory / "data")
            if found is not None and found != cluster_id:
                raise BrokerError(
                    f"{node.directory / 'data'} was formatted for cluster {found}, not {cluster_id}: it belongs to "
                    f"another cluster. Give another --data-dir (nothing was deleted)"
                )
        return cluster_id

    def _format(self, cluster_id: str) -> None:
        """kafka-storage.sh format, for each node not formatted yet, all at once (a JVM each)."""
        pending = [n for n in self.nodes if _meta_cluster_id(n.directory / "data") is None]
        running = []
        for node in pending:
            properties = str(node.directory / "server.properties")
            command = [*self._java("kafka.tools.StorageTool", node), "format", "-t", cluster_id, "-c", properties]
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent(signal.SIGKILL),  # noqa: PLW1509 - see lifeline
            )
            running.append((node, process))
        for node, process in running:
            output, _ = process.communicate(timeout=START_TIMEOUT_S)
            if process.returncode != 0:
                raise BrokerError(
                    f"formatting {node.directory} for Apache Kafka failed (exit {process.returncode}): "
                    f"{output.decode(errors='replace').strip()[-1500:]}"
                )
        record = self.data_dir / CLUSTER_FILE
        if not record.is_file():
            temp = record.with_suffix(".tmp")
            temp.write_text(json.dumps({"cluster_id": cluster_id, "nodes": len(self.nodes), "version": self.version}))
            temp.replace(record)
        if pending:
            logger.info("broker storage formatted cluster_id=%s nodes=%s", cluster_id, [n.node_id for n in pending])

    def _java(self, main_class: str, node: Node) -> list[str]:
        # The release's scripts give a broker KAFKA_HEAP_OPTS and a tool 256 MiB.
        broker = main_class == "kafka.Kafka"
        heap = os.environ.get(HEAP_ENV, DEFAULT_HEAP).split() if broker else ["-Xmx256m"]
        # As kafka-server-start.sh (-loggc): a node's GC log beside its server.log, here with the
        # safepoints too, so that a node that stopped answering (one stalled 12 s beside a busy
        # neighbour, and its controller fenced it) can be told from a paused JVM at once.
        gc_log = [f"-Xlog:gc*,safepoint:file={node.directory / GC_LOG}:time,tags:filecount=2,filesize=20M"]
        # As kafka-run-class.sh: KAFKA_JVM_PERFORMANCE_OPTS replaces the JVM settings, KAFKA_OPTS adds to them.
        performance = os.environ.get("KAFKA_JVM_PERFORMANCE_OPTS")
        options = [
            *heap,
            *(performance.split() if performance is not None else JVM_OPTS),
            *os.environ.get("KAFKA_OPTS", "").split(),
        ]
        sharing: list[str] = []
        if self._archive is not None:  # one node of the cluster writes it, if none was written yet
            writer = broker and not any(n.archive_partial for n in self.nodes if n is not node)
            sharing, node.archive_partial = self._archive.flags(options, writer)
        return [
            "java",
            *(gc_log if broker else []),
            *options,
            *sharing,
            f"-Dkafka.logs.dir={node.directory}",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp",
            self._classpath,
            main_class,
        ]

    def node(self, node_id: int) -> Node:
        return self.nodes[node_id - 1]

    def start_node(self, node_id: int, wait: bool = True) -> None:
        """Start one node (again, after stop_node or kill_node); with `wait`, until it is a broker again."""
        node = self.node(node_id)
        if node.running:
            return
        with (node.directory / "console.log").open("ab") as console:
            # A session of its own: Ctrl-C in a terminal reaches the sidecar, which stops the nodes in order.
            node.process = subprocess.Popen(
                [*self._java("kafka.Kafka", node), str(node.directory / "server.properties")],
                stdout=console,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),  # noqa: PLW1509 - see lifeline
            )
        (node.directory / "pid").write_text(str(node.process.pid))
        logger.info("broker node starting node=%d pid=%d port=%d", node_id, node.process.pid, self.broker_port(node_id))
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every running node is a registered broker that answers metadata requests."""
        # "Connection refused" while the nodes start is expected, not news: the client logs nothing.
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        deadline = time.monotonic() + timeout_s
        while True:
            for node in self.nodes:
                if node.process is not None and node.process.poll() is not None:
                    raise BrokerError(
                        f"Apache Kafka node {node.node_id} exited with code {node.process.returncode} while "
                        f"starting; its log ({node.directory / 'server.log'}) ends:\n{node.log_tail()}"
                    )
            wanted = {n.node_id for n in self.nodes if n.running}
            try:
                brokers = set(admin.list_topics(timeout=2.0).brokers)
            except Exception:  # the client raises KafkaException or a timeout while the nodes start
                brokers = set()
            if wanted <= brokers:
                return
            if time.monotonic() >= deadline:
                tails = "\n".join(f"node {n.node_id}:\n{n.log_tail()}" for n in self.nodes if n.node_id not in brokers)
                raise BrokerError(
                    f"Apache Kafka did not answer with nodes {sorted(wanted)} within {timeout_s:.0f}s (answered: "
                    f"{sorted(brokers)}); the logs end:\n{tails}"
                )
            time.sleep(0.2)

    def stop_node(self, node_id: int, grace_s: float = STOP_GRACE_S) -> None:
        """A controlled shutdown of one node (SIGTERM), killed if it takes longer than the grace."""
        self._stop([self.node(node_id)], grace_s)

    def kill_node(self, node_id: int) -> None:
        """kill -9 of one node: a crash, as a fault test wants it."""
        node = self.node(node_id)
        if node.process is not None and node.running:
            node.process.kill()
            node.process.wait()
        self._ended(node)

    def pause_node(self, node_id: int) -> None:
        process = self.node(node_id).process
        if process is not None:
            process.send_signal(signal.SIGSTOP)

    def resume_node(self, node_id: int) -> None:
        process = self.node(node_id).process
        if process is not None:
            process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self._stop(self.nodes, STOP_GRACE_S)

    def _ended(self, node: Node) -> None:
        """A node's process is gone (or never started): keep the class archive it wrote on its way out."""
        if node.archive_partial is not None and self._archive is not None:
            exit_code = node.process.returncode if node.process is not None else None
            self._archive.settle(node.archive_partial, -1 if exit_code is None else exit_code)
        node.archive_partial = None
        node.process = None

    def _has_quorum(self) -> bool:
        """A majority of the nodes (every node is a controller) still running."""
        return 2 * sum(1 for n in self.nodes if n.running) > len(self.nodes)

    def _kill_at(self, nodes: list[Node], deadline: float, why: str) -> None:
        """Wait until `deadline` for `nodes` to exit, then kill those still running, saying why."""
        for node in nodes:
            assert node.process is not None
            try:
                node.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("broker node killed: %s node=%d pid=%d", why, node.node_id, node.process.pid)
                node.process.kill()
                node.process.wait()

    def _stop(self, nodes: list[Node], grace_s: float) -> None:
        """SIGTERM, which is a controlled shutdown: the node's broker asks the controller quorum to
        move its leaders away and waits for the answer. A node left without a quorum (a majority of
        the nodes stopped) never gets one, so it is killed once the quorum is gone, after a short
        grace for a node already past that step, not after `grace_s`: so do Kafka's system tests.
        (The last node of three stopped together waited the full 60 s and was killed even so.)"""
        began = time.monotonic()
        stopping = [n for n in nodes if n.running]
        for node in stopping:
            assert node.process is not None
            node.process.send_signal(signal.SIGCONT)  # a paused node cannot stop
            node.process.send_signal(signal.SIGTERM)
        deadline = began + grace_s
        late = f"it did not stop within {grace_s:.0f}s"
        waiting = list(stopping)
        while waiting:
            waiting = [n for n in waiting if n.running]
            if waiting and not self._has_quorum():
                quorumless = time.monotonic() + QUORUMLESS_GRACE_S
                self._kill_at(waiting, min(deadline, quorumless), NO_QUORUM if quorumless < deadline else late)
                break
            if waiting and time.monotonic() >= deadline:
                self._kill_at(waiting, deadline, late)
                break
            time.sleep(0.05)
        for node in nodes:
            self._ended(node)
        if stopping:
            logger.info(
                "broker stopped kind=apache-kafka nodes=%s stop_s=%.1f",
                [n.node_id for n in stopping],
                time.monotonic() - began,
            )


def _meta_cluster_id(log_dir: Path) -> str | None:
    """The cluster.id in a formatted log dir's meta.properties; None when it was never formatted."""
    try:
        lines = (log_dir / "meta.properties").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "cluster.id":
            return value.strip()
    return None
