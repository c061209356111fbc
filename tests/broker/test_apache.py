"""The Apache Kafka launcher against real JVMs: a node's start and restart, its refusals, and no
orphan. (Its 3-node cluster is tested on tests/failover's, which starts one anyway.)

Each test starts brokers of its own (a few seconds each). Deadlines are generous: a test fails
only when something never happens.
"""

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from sidecar.broker import ApacheKafka, EmbeddedBroker, apache
from sidecar.broker.apache import GC_LOG
from sidecar.broker.class_archive import ClassArchive
from sidecar.broker.jars import CACHE_ENV, fetch_kafka, kafka_libs, missing_tools
from sidecar.broker.local import local_broker, resolve_kind
from sidecar.broker.ports import free_port, free_ports
from sidecar.errors import BrokerError
from tests.broker.test_orphans import gone, wait_until
from tests.broker.test_ports import reservable_by_another_process
from tests.kafka_helpers import ROOT


def topic_replicas(bootstrap: str, name: str, partitions: int) -> dict[int, list[int]]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions)])[name].result(30)
    found: dict[int, list[int]] = {}

    def described() -> bool:
        topic = admin.list_topics(name, timeout=5).topics.get(name)
        if topic is None or topic.error is not None or len(topic.partitions) < partitions:
            return False
        found.update({p: list(m.replicas) for p, m in topic.partitions.items()})
        return True

    wait_until(described, f"metadata of {name}")
    return found


def test_a_restart_keeps_the_data_and_the_ports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: the JVM settings come from the environment as the release's scripts read them, and a
    node writes its GC log (with the safepoints) beside its server.log, as kafka-server-start.sh's.
    Asked for one free port, as tests/conftest.py does, it holds both of its ports while stopped."""
    port = free_port()
    cluster = ApacheKafka(tmp_path / "kafka", port=port)
    with cluster:
        first = cluster.bootstrap_servers
        topic_replicas(first, "kept", 1)
        node = cluster.nodes[0].process
        assert node is not None
        command = psutil.Process(node.pid).cmdline()
        assert "-XX:+UseG1GC" in command and "-XX:TieredStopAtLevel=1" in command  # tests/conftest.py's KAFKA_OPTS
        gc_log = (cluster.nodes[0].directory / GC_LOG).read_text()
        assert "[gc" in gc_log and "[safepoint" in gc_log, gc_log[-2000:]
    assert not reservable_by_another_process(port) and not reservable_by_another_process(port + 1)
    monkeypatch.setenv("KAFKA_JVM_PERFORMANCE_OPTS", "-XX:+UseSerialGC")
    with cluster:
        node = cluster.nodes[0].process
        assert node is not None
        command = psutil.Process(node.pid).cmdline()
        assert "-XX:+UseSerialGC" in command and "-XX:+UseG1GC" not in command
        assert cluster.bootstrap_servers == first
        assert "kept" in AdminClient({"bootstrap.servers": first}).list_topics(timeout=10).topics


def mapped(cluster: ApacheKafka, archive: Path) -> bool:
    """Whether the node's JVM has the archive mapped: it took its classes from it."""
    process = cluster.nodes[0].process
    assert process is not None
    return str(archive) in Path(f"/proc/{process.pid}/maps").read_text()


def test_the_first_clean_stop_writes_the_class_archive_and_later_nodes_map_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept out of the user's cache here: the archive goes to tmp_path. A damaged archive is the
    JVM's to refuse: the node starts all the same. A killed writer leaves nothing behind."""
    monkeypatch.setattr(apache, "ClassArchive", lambda _folder: ClassArchive(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    archive = ClassArchive(tmp_path / "cache").path
    cluster = ApacheKafka(tmp_path / "kafka", port=free_ports(2))
    with cluster:
        assert not mapped(cluster, archive)
        cluster.kill_node(1)
        assert list((tmp_path / "cache").iterdir()) == []
        cluster.start_node(1)
    assert archive.is_file() and archive.stat().st_size > 1_000_000
    assert list((tmp_path / "cache").iterdir()) == [archive]
    with cluster:
        assert mapped(cluster, archive)
        assert AdminClient({"bootstrap.servers": cluster.bootstrap_servers}).list_topics(timeout=10).brokers
    archive.chmod(0o644)
    archive.write_bytes(b"not an archive" * 1000)
    with cluster:
        assert not mapped(cluster, archive)
        assert AdminClient({"bootstrap.servers": cluster.bootstrap_servers}).list_topics(timeout=10).brokers


def test_a_port_in_use_moves_the_node_to_free_ports(tmp_path: Path) -> None:
    port = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with ApacheKafka(tmp_path / "kafka", port=port) as cluster:
            assert cluster.bootstrap_servers != f"127.0.0.1:{port}"
            assert AdminClient({"bootstrap.servers": cluster.bootstrap_servers}).list_topics(timeout=10).brokers


def test_a_data_dir_that_is_not_ours_is_refused_and_kept(tmp_path: Path) -> None:
    data = tmp_path / "kafka"
    data.mkdir()
    (data / "orders.log").write_text("someone's data")
    with pytest.raises(BrokerError, match=r"not an Apache Kafka data dir of this launcher.*nothing was deleted"):
        ApacheKafka(data, port=free_ports(2)).start()
    assert (data / "orders.log").read_text() == "someone's data"
    assert sorted(p.name for p in data.iterdir()) == ["orders.log"]


def test_a_data_dir_of_another_cluster_or_size_is_refused_and_kept(tmp_path: Path) -> None:
    data = tmp_path / "kafka"
    with ApacheKafka(data, port=free_ports(2)):
        pass
    before = sorted(str(p) for p in data.rglob("*"))
    with pytest.raises(BrokerError, match=r"holds a cluster of 1 nodes, not 3.*--nodes 1"):
        ApacheKafka(data, port=free_ports(6), nodes=3).start()
    record = data / "cluster.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "cluster_id": "AAAAAAAAAAAAAAAAAAAAAA"}))
    with pytest.raises(BrokerError, match=r"was formatted for cluster .*, not AAAAAAAAAAAAAAAAAAAAAA"):
        ApacheKafka(data, port=free_ports(2)).start()
    assert sorted(str(p) for p in data.rglob("*")) == before


def test_a_node_that_fails_to_start_is_reported_with_the_end_of_its_log(tmp_path: Path) -> None:
    data = tmp_path / "kafka"
    with ApacheKafka(data, port=free_ports(2)):
        pass
    meta = data / "node-1" / "data" / "meta.properties"
    meta.write_text(meta.read_text().replace("node.id=1", "node.id=7"))  # storage of another node
    with pytest.raises(BrokerError, match=r"(?s)node 1 exited with code 1 while starting.*ends:.*node id 7"):
        ApacheKafka(data, port=free_ports(2)).start()


@pytest.fixture
def broker_command(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    log = tmp_path / "broker.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "broker", "--broker-kind", "apache-kafka", "--port", str(free_ports(2)),
             "--data-dir", str(tmp_path / "kafka")],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    try:
        wait_until(lambda: "broker ready:" in log.read_text() or process.poll() is not None, "broker ready", 180)
        assert process.poll() is None, log.read_text()
        yield process, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def jvms(parent: psutil.Process) -> list[psutil.Process]:
    return [p for p in parent.children(recursive=True) if "kafka.Kafka" in " ".join(p.cmdline())]


def test_no_jvm_outlives_a_killed_broker_command(broker_command: tuple[subprocess.Popen[bytes], Path]) -> None:
    process, _ = broker_command
    children = jvms(psutil.Process(process.pid))
    assert len(children) == 1
    process.kill()
    process.wait()
    wait_until(lambda: all(gone(c) for c in children), "the JVM gone after a kill -9 of its parent")


def test_sigterm_stops_the_broker_command_cleanly(broker_command: tuple[subprocess.Popen[bytes], Path]) -> None:
    process, log = broker_command
    assert "Apache Kafka 4." in log.read_text()
    children = jvms(psutil.Process(process.pid))
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, log.read_text()
    assert all(gone(c) for c in children)
    assert "broker stopped kind=apache-kafka" in log.read_text().replace('"', "")


def path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only these tools (as links to the real ones)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for tool in tools:
        real = subprocess.run(["which", tool], capture_output=True, text=True, check=True).stdout.strip()
        (folder / tool).symlink_to(real)
    return str(folder)


def test_without_java_auto_falls_back_to_noida_db_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", path_with(tmp_path))
    caplog.set_level("INFO")
    assert missing_tools() == "no Java on PATH (Apache Kafka needs Java 17 or newer)"
    assert resolve_kind("auto") == "noida-db"
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("broker chosen")]
    assert len(chosen) == 1 and "kind=noida-db" in chosen[0], chosen
    assert "no Java on PATH" in chosen[0] and "falling back to the embedded broker" in chosen[0], chosen
    fallback = local_broker("auto", None)
    assert isinstance(fallback, EmbeddedBroker) and fallback.data_dir == Path(".state/broker")
    with pytest.raises(BrokerError, match=r"cannot start Apache Kafka: no Java on PATH.*--broker-kind noida-db"):
        local_broker("apache-kafka", tmp_path / "kafka")


def test_without_maven_and_no_cached_jars_auto_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", path_with(tmp_path, "java"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "empty-cache"))
    assert (missing_tools() or "").startswith("no Maven on PATH to fetch Apache Kafka"), missing_tools()
    assert resolve_kind("auto") == "noida-db"


def test_maven_that_cannot_reach_its_repository_names_the_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real Maven, pointed at a repository that refuses connections and an empty local repository."""
    home = tmp_path / "home"
    (home / ".m2").mkdir(parents=True)
    (home / ".m2" / "settings.xml").write_text(
        "<settings><localRepository>" + str(tmp_path / "m2") + "</localRepository><mirrors><mirror><id>nowhere</id>"
        f"<mirrorOf>*</mirrorOf><url>http://127.0.0.1:{free_port()}/maven2</url></mirror></mirrors></settings>"
    )
    monkeypatch.setenv("MAVEN_OPTS", f"-Duser.home={home}")  # Maven finds settings.xml under Java's user.home
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(BrokerError) as raised:
        fetch_kafka()
    message = str(raised.value)
    assert "Maven could not reach its repository to fetch org.apache.kafka:kafka_2.13:" in message, message
    assert f"Fill {tmp_path / 'cache'}" in message, message
    assert not (kafka_libs() / "complete").exists()
