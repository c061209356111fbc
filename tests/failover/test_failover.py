"""Failover on a 3-node Apache Kafka (issue 42, item 2): the suite's short version of bench/failover.py.

One cluster for the module (three KRaft nodes, each broker and controller), every node running and
every partition fully replicated again before each test. Each test runs a sidecar process of its
own on a fresh inbound topic (3 partitions, 3 replicas, min.insync.replicas 2), produces delayed
records at a steady rate from before the fault to after it (each due 0.5-3 s after it is produced,
so records fall due all through the fault), strikes one fault, and counts every record of both
outbound topics twice, per record (Counters, so a second copy shows): a fresh read_committed read
from offset 0 to the high watermark, and a read_committed reader that kept reading through the
fault. Against the inbound topic's records: none lost, none duplicated, none early, in both
guarantees (the outbound leader's kill runs at least once: a broker fault repeats nothing a running
sidecar wrote), and /healthz answers ready all through it. At least once through every fault is
bench/failover.py's (`--guarantees`).

No wall-clock limit is asserted: every wait is for a condition, with a generous deadline. The faults
themselves are bench/failover.py's, shared with the full version.
"""

import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from bench.failover import (
    PARTITIONS,
    STRIKES,
    TRANSACTION_STATE,
    Load,
    Struck,
    admin,
    health,
    leader_of,
    new_stage,
    now_ms,
    partition_count,
    restore,
    wait_until,
)
from sidecar.broker.admin import TopicAdmin
from sidecar.broker.apache import ApacheKafka
from sidecar.broker.ports import free_ports
from sidecar.errors import BrokerError
from sidecar.settings import SESSION_TIMEOUT_MS, RunSettings
from tests.broker.test_apache import topic_replicas
from tests.kafka_helpers import (
    ROOT,
    KafkaHelper,
    LiveReader,
    Received,
    SidecarProcess,
    broker_kind_of_run,
    deliveries,
    early,
    run_args,
    wait_for,
)

pytestmark = pytest.mark.skipif(
    broker_kind_of_run() == "noida-db",
    reason="failover needs a 3-node Apache Kafka; noida-db, the run's broker, has no multi-node mode",
)

RATE = 150
"""Records produced per second: a few thousand in a test, with records due every few ms."""
HOLD_S = 2.0
"""How long a killed or paused node stays away once the cluster has moved on without it."""
DEADLINE_S = 180.0
Origin = tuple[int, int, int]


INTERNAL_PARTITIONS = {"offsets.topic.num.partitions": 6, "transaction.state.log.num.partitions": 6}
"""Kafka's 50 each are loaded and elected again at every node start, and the faults need a
coordinator to move, not 50 of them. Measured alone, with the earlier trials' topics deleted too,
the rolling restart went from 402 to 381 s: the nodes' JVMs starting on two busy cores cost more."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApacheKafka]:
    """One 3-node cluster for the module: a start costs 15-20 s of the two cores. Its stop is
    checked too: the launcher stops a cluster with a controlled shutdown of every node."""
    directory = tmp_path_factory.mktemp("failover") / "kafka"
    launcher = ApacheKafka(directory, port=free_ports(6), nodes=3, settings=INTERNAL_PARTITIONS)
    kills, apache_log = Recorded(), logging.getLogger("sidecar.broker.apache")
    with launcher:
        yield launcher
        restore(launcher)  # the last test may have left a node away
        processes = [node.process for node in launcher.nodes]
        before = [controlled_shutdowns(node.directory) for node in launcher.nodes]
        apache_log.addHandler(kills)
        try:
            # Nodes 3 and 2 one at a time, each with a quorum left (neither killed); then node 1
            # alone, which no quorum can answer any more: killed at once, saying why (it used to
            # wait the 60 s grace).
            launcher.stop_node(3)
            launcher.stop_node(2)
            launcher.stop()
        finally:
            apache_log.removeHandler(kills)
    assert all(p is not None and p.returncode is not None for p in processes), processes
    after = [controlled_shutdowns(node.directory) for node in launcher.nodes]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert [m for m in kills.messages if "killed" in m] == [
        f"broker node killed: the controller quorum is gone, so it cannot finish a controlled shutdown node=1 "
        f"pid={processes[0].pid if processes[0] else None}"
    ], kills.messages


class Recorded(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def controlled_shutdowns(directory: Path) -> int:
    return (directory / "server.log").read_text().count("Beginning controlled shutdown")


@pytest.fixture(autouse=True)
def healthy(cluster: ApacheKafka) -> None:
    """Each test starts on a whole cluster, whatever the one before left killed or paused, without
    the topics of the trials before it: each trial leaves 24 partitions (its state topic has 12),
    which every later restart of a node would load again."""
    restore(cluster)
    client = admin(cluster.bootstrap_servers)
    done = {t for t in client.list_topics(timeout=10).topics if t.startswith("failover-")}
    if done:
        for future in client.delete_topics(list(done)).values():
            future.result(30)
        wait_until(lambda: not done & client.list_topics(timeout=10).topics.keys(), "the last trials' topics gone")


class Trial:
    """A sidecar, a load, a live reader and a /healthz sampler on one stage, through one fault."""

    def __init__(self, cluster: ApacheKafka, tmp_path: Path, guarantee: str) -> None:
        self.stage, policies = new_stage(cluster, tmp_path, guarantee, HOLD_S)
        stage = self.stage
        # The product's session timeout, not the suite's shorter one: on three nodes, one node's
        # death holds the group's heartbeats back (test_the_default_session_outlasts_...).
        args = run_args(stage.bootstrap, policies, tmp_path / f"{stage.inbound}-state", stage.health_port,
                        stage.group, "--processing-guarantee", guarantee,
                        "--session-timeout-ms", str(SESSION_TIMEOUT_MS))  # fmt: skip
        self.sidecar = SidecarProcess(args, stage.sidecar_log)
        self.helper = KafkaHelper(stage.bootstrap)
        self.live: LiveReader | None = None
        self.load: Load | None = None
        self.began = time.monotonic()
        self.healthz: Counter[int] = Counter()
        """/healthz answers from the start of the load to the end of the fault, every 0.5 s."""
        self.samples: list[tuple[int, int]] = []
        """The same answers with when they were asked (ms since the epoch)."""
        self._sampling = threading.Event()
        self.leaders: dict[str, set[int]] = {}
        """Per topic of the stage, the nodes that led a partition of it just before the fault."""

    def seen(self) -> int:
        return sum(len(records) for records in self.live.records.values()) if self.live is not None else 0

    def begin(self) -> None:
        """Sidecar ready, records being produced, falling due and delivered."""
        stage = self.stage
        self.sidecar.start()
        wait_for(lambda: health(stage.health_port)[0] == 200, DEADLINE_S, "the sidecar ready")
        self.live = LiveReader(stage.bootstrap, stage.outbound, PARTITIONS)
        stage.delivered = self.seen
        self.load = Load(stage.bootstrap, stage.inbound, RATE, idempotent=False).start()
        threading.Thread(target=self._sample, daemon=True).start()
        wait_for(lambda: self.seen() >= RATE, DEADLINE_S, "deliveries before the fault")
        self.leaders = {
            t: {leader_of(stage.bootstrap, t, p) for p in range(PARTITIONS)} for t in [stage.inbound, *stage.outbound]
        }
        self.phase(f"{stage.guarantee}: records delivered before the fault")

    def _sample(self) -> None:
        while not self._sampling.is_set():
            asked = now_ms()
            code = health(self.stage.health_port)[0]
            self.healthz[code] += 1
            self.samples.append((asked, code))
            time.sleep(0.5)

    def ready_through(self, struck: Struck) -> None:
        """/healthz said ready all through a fault that left two of three nodes up: they serve every
        partition (a rolling restart once turned it 503, which would have had Kubernetes restart the pod).
        Exactly once, a node's death can leave librdkafka's send_offsets_to_transaction waiting 35 s
        (docs/reliability.md, known limits), and /healthz then truthfully says the loop waits: the
        at-least-once test asserts this."""
        during = [code for at, code in self.samples if struck.began_ms <= at <= struck.ended_ms]
        assert during, "no /healthz answer was sampled during the fault"
        assert set(during) == {200}, f"/healthz during {struck.fault}: {Counter(during)}"

    def resumed(self) -> None:
        """After the fault: the same sidecar process delivers records produced since."""
        self._sampling.set()
        assert self.sidecar.process is not None and self.sidecar.process.poll() is None, self.sidecar.tail()
        after = self.seen()
        wait_for(lambda: self.seen() >= after + RATE, DEADLINE_S, "deliveries after the fault")
        self.phase(f"{self.stage.guarantee}: records delivered after the fault; /healthz {dict(self.healthz)}")

    def strike(self, fault: str) -> Struck:
        self.begin()
        struck = STRIKES[fault](self.stage)
        self.phase(f"fault over: {struck.detail} {struck.facts}")
        self.resumed()
        return struck

    def phase(self, what: str) -> None:
        """A line per step with the seconds since the trial began: where a slow test spent its time."""
        print(f"[{time.monotonic() - self.began:6.1f} s] {what}", flush=True)

    def count(self) -> tuple[set[Origin], dict[str, list[Received]], dict[str, list[Received]]]:
        """Stop the load, wait for every record on every outbound topic, stop the sidecar; the
        inbound records (as origins), and both readers' records per outbound topic."""
        assert self.load is not None and self.live is not None
        produced = self.load.stop()
        inbound = self.read_to_end(self.stage.inbound)
        expected = {(r.partition, r.offset, 0) for r in inbound}
        # The inbound topic is the truth: a record whose acknowledgement was lost in a roll (its delivery
        # report an error) can still have been written (44,465 records, 44,464 acknowledged), and the
        # load, not idempotent, can have written a retried record twice (two records to deliver).
        sent, distinct = self.load.sent, len({r.value for r in inbound})
        assert produced <= distinct <= sent, f"{distinct} distinct inbound records: {produced} acked, {sent} sent"
        live = self.live

        def all_seen() -> bool:
            return all(expected <= deliveries(list(live.records[t])).keys() for t in self.stage.outbound)

        wait_for(all_seen, DEADLINE_S, "every record seen by the live reader")
        assert self.sidecar.process is not None and self.sidecar.process.poll() is None, self.sidecar.tail()
        assert self.sidecar.stop() == 0, self.sidecar.tail()
        seen_live = live.finish(DEADLINE_S)
        fresh = {t: self.read_to_end(t, committed_only=True) for t in self.stage.outbound}
        self.phase(f"{self.stage.guarantee}: {produced} records; sidecar stopped, both readers done")
        return expected, fresh, seen_live

    def read_to_end(self, topic: str, committed_only: bool = False) -> list[Received]:
        """KafkaHelper.read_to_end, asked again while a leader moves: just after a fault the client's
        metadata can be stale, and the watermark request answers NOT_LEADER_FOR_PARTITION."""
        read: list[list[Received]] = []

        def done() -> bool:
            read.append(self.helper.read_to_end(topic, committed_only=committed_only))
            return True

        wait_for(done, DEADLINE_S, f"{topic} read to its end")
        return read[-1]

    def close(self) -> None:
        self._sampling.set()
        self.sidecar.close()
        if self.load is not None:
            self.load.close()
        self.helper.close()


@pytest.fixture
def trials(cluster: ApacheKafka, tmp_path: Path) -> Iterator[list[Trial]]:
    made: list[Trial] = []
    yield made
    for trial in made:
        trial.close()


def check(expected: set[Origin], records: list[Received], where: str) -> None:
    """Each inbound record exactly once: none lost, none twice, none early, nothing else."""
    copies: Counter[Origin] = deliveries(records)
    lost = sorted(expected - copies.keys())
    strays = sorted(copies.keys() - expected)
    twice = {origin: n for origin, n in copies.items() if n > 1}
    assert not lost, f"{where}: {len(lost)} of {len(expected)} lost, e.g. {lost[:5]}"
    assert not strays, f"{where}: {len(strays)} records of no inbound record, e.g. {strays[:5]}"
    assert not early(records), f"{where}: {len(early(records))} delivered early"
    assert not twice, f"{where}: {len(twice)} delivered more than once, e.g. {list(twice.items())[:5]}"


def assert_each_once(trial: Trial) -> None:
    expected, fresh, live = trial.count()
    for topic in trial.stage.outbound:
        check(expected, fresh[topic], f"{topic} (fresh read)")
        check(expected, live[topic], f"{topic} (live reader)")
    print(f"records={len(expected)}")


def test_three_nodes_replicate_by_three(cluster: ApacheKafka) -> None:
    """The launcher's 3-node cluster (its controlled shutdown is the `cluster` fixture's check).
    First in the module: the cluster is fresh."""
    assert cluster.bootstrap_servers.count(",") == 2
    replicas = topic_replicas(cluster.bootstrap_servers, "failover-replicated", 3)
    assert all(sorted(r) == [1, 2, 3] for r in replicas.values()), replicas
    # A fresh cluster's group coordinator answers NOT_COORDINATOR at first: the sidecar's read of its
    # group's offsets must survive it (librdkafka's admin call crashed the process there). In a child,
    # so that a crash fails this test instead of killing the worker.
    read = subprocess.run(
        [sys.executable, "-c", "import sys; from sidecar.broker.admin import TopicAdmin; "
         "print(TopicAdmin({'bootstrap.servers': sys.argv[1]}, 1).group_offsets('fresh-group'))",
         cluster.bootstrap_servers],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    assert read.returncode == 0 and read.stdout.strip() == "{}", read
    assert_new_topics_replicated_and_single_replicas_named(cluster.bootstrap_servers)


def assert_new_topics_replicated_and_single_replicas_named(bootstrap: str) -> None:
    """Topics the sidecar creates get 3 replicas and min.insync.replicas 2 on 3 brokers, or what
    --replication-factor says; a topic it relies on with one replica is named. (Named failover-*:
    the next test's `healthy` deletes them.)"""
    config = {"bootstrap.servers": bootstrap}
    plain = AdminClient(config)  # kept referenced: a client destroyed under its future fails it
    plain.create_topics([NewTopic("failover-thin", 1, replication_factor=1)])["failover-thin"].result(30)
    admin = TopicAdmin(config, 2)
    assert admin.replication() == (3, 2)
    admin.create({"failover-made": 2})
    explicit = TopicAdmin(config, 2, replication_factor=2)
    explicit.create({"failover-made-2": 2})
    for name, factor, min_isr in (("failover-made", 3, "2"), ("failover-made-2", 2, "1")):
        partitions = plain.list_topics(name, timeout=10).topics[name].partitions
        assert {len(p.replicas) for p in partitions.values()} == {factor}, name
        resource = ConfigResource("topic", name)
        described = plain.describe_configs([resource])[resource].result(30)
        assert described["min.insync.replicas"].value == min_isr, name
    assert admin.warn_unreplicated(["failover-thin", "failover-made", "missing"]) == ["failover-thin"]
    with pytest.raises(BrokerError, match=r"lower --replication-factor \(it is 4\)"):
        TopicAdmin(config, 1, replication_factor=4).create({"failover-too-wide": 1})


def test_the_default_session_outlasts_the_heartbeats_one_node_s_death_holds_back(cluster: ApacheKafka) -> None:
    """Kafka 4's group coordinator answers a heartbeat only once the group's last offset commit is
    replicated, which waits for a dead node to leave the offsets partition's ISR: until the
    controller fences it (broker.session.timeout.ms), then the heartbeats queued behind the commit
    time out (offsets.commit.timeout.ms), and the last answer before the death was up to a heartbeat
    interval earlier (librdkafka's heartbeat.interval.ms, 3 s). At the default of 15 s, a live
    sidecar's session lapsed through the outbound leader's kill below in a loaded CI run, and the
    engine started again (/healthz 503). Read from this cluster's nodes, not assumed."""
    client = admin(cluster.bootstrap_servers)  # kept referenced: a client destroyed under its future fails it

    def configs(node: int) -> dict[str, str]:
        resource = ConfigResource("broker", str(node))  # one broker per call, Kafka's rule
        return {
            k: v.value for k, v in client.describe_configs([resource], request_timeout=10)[resource].result(30).items()
        }

    stall_ms = 3_000 + max(
        int(c["broker.session.timeout.ms"]) + int(c["offsets.commit.timeout.ms"])
        for c in (configs(node.node_id) for node in cluster.nodes)
    )
    default = RunSettings().session_timeout_ms
    assert default >= 2 * stall_ms, f"--session-timeout-ms {default} against a heartbeat stall of up to {stall_ms} ms"


def test_kill_of_an_outbound_leader_at_least_once(cluster: ApacheKafka, tmp_path: Path, trials: list[Trial]) -> None:
    """At least once, a broker fault repeats nothing this running sidecar wrote (docs/contract.md):
    each record once, as exactly once, counted by a fresh read and by a reader that kept reading."""
    trial = Trial(cluster, tmp_path, "at-least-once")
    trials.append(trial)
    struck = trial.strike("outbound-leader")
    assert struck.facts["new_leader"] != struck.nodes[0]
    assert struck.nodes[0] != struck.facts["group_coordinator"], "an outbound leader that is not the coordinator"
    trial.ready_through(struck)
    assert_each_once(trial)


def test_kill_of_the_transaction_coordinator(cluster: ApacheKafka, tmp_path: Path, trials: list[Trial]) -> None:
    """The node struck is the one that coordinated the sidecar's transactional.id: its own log says
    it initialized that id on the __transaction_state partition computed from the id's hash. It led
    a partition of the inbound topic and of each outbound topic too (a topic's 3 partitions are led
    by the 3 nodes), so this kill is also an inbound and an outbound leader's: the test of an
    inbound leader's kill alone proved nothing more, and went (bench/failover.py keeps it)."""
    trial = Trial(cluster, tmp_path, "exactly-once")
    trials.append(trial)
    struck = trial.strike("coordinator")
    assert all(struck.nodes[0] in led for led in trial.leaders.values()), (struck.nodes, trial.leaders)
    server_log = (cluster.node(struck.nodes[0]).directory / "server.log").read_text(errors="replace")
    partition = f"{TRANSACTION_STATE}-{struck.facts['partition']}"
    initialized = [line for line in server_log.splitlines() if str(struck.facts["transactional_id"]) in line]
    assert any(partition in line for line in initialized), (partition, initialized[:3])
    expected = INTERNAL_PARTITIONS["transaction.state.log.num.partitions"]  # the launcher's settings took
    assert partition_count(cluster.bootstrap_servers, TRANSACTION_STATE) == expected
    assert_each_once(trial)


def test_a_node_paused_past_its_session_timeout(cluster: ApacheKafka, tmp_path: Path, trials: list[Trial]) -> None:
    """SIGSTOP of the group coordinator's node until the controller fenced it, then SIGCONT."""
    trial = Trial(cluster, tmp_path, "exactly-once")
    trials.append(trial)
    struck = trial.strike("pause")
    print(struck.facts)
    assert_each_once(trial)


def test_the_majority_lost_then_back(cluster: ApacheKafka, tmp_path: Path, trials: list[Trial]) -> None:
    """Two of three nodes killed for 10 s or more: /healthz answers 503, nothing is delivered while
    the majority is away, and delivery resumes by itself (the same sidecar process) once it is back."""
    trial = Trial(cluster, tmp_path, "exactly-once")
    trials.append(trial)
    struck = trial.strike("majority")
    print(struck.facts)
    assert struck.facts["away_s"] >= 10  # type: ignore[operator]
    assert struck.facts["delivered_before_back"] == struck.facts["delivered_at_503"], "delivered without a majority"
    wait_for(lambda: health(trial.stage.health_port)[0] == 200, DEADLINE_S, "/healthz ready again by itself")
    assert_each_once(trial)


def test_a_rolling_restart_under_load(cluster: ApacheKafka, tmp_path: Path, trials: list[Trial]) -> None:
    """Each node in turn: a controlled stop, a start, full ISRs. Exactly once, as the other faults
    here: the roll is the module's longest test. In CI it took 366 s with a second sidecar beside it,
    at least once, and 168 s without (and with the smaller internal topics), and the tests around it
    ran faster too. bench/failover.py rolls with both guarantees."""
    trial = Trial(cluster, tmp_path, "exactly-once")
    trials.append(trial)
    trial.strike("rolling")  # prints what it struck
    assert_each_once(trial)
