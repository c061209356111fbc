"""Shared fixtures: one broker for the whole run, a unique topic per test, a clock the test controls.

The broker is, in order: the cluster named by KAFKA_BOOTSTRAP_SERVERS; else the kind named by
DELAY_SIDECAR_TEST_BROKER: `apache-kafka` (the default: one Apache Kafka node that the controlling
pytest process starts before its xdist workers, which all share it, since every test's topics are
its own) or `noida-db` (the fallback; an embedded broker per worker, for the tests marked
`fallback`, which scripts/test.sh runs on it too). No test is skipped for want of a broker.
"""

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import HealthCheck, settings
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

from sidecar.app import EMBEDDED_IDLE_FETCH_PAUSE_MS
from sidecar.broker import ApacheKafka, BrokerLauncher, EmbeddedBroker, ExternalBroker
from sidecar.broker.ports import free_port
from sidecar.clock import ManualClock
from tests.kafka_helpers import KafkaHelper, broker_kind_of_run

# CI must never fail by chance: on a loaded two-core machine a slow example is not a bug, so the
# suite runs without hypothesis' deadline and too_slow check. HYPOTHESIS_PROFILE=default restores them.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Every JVM the tests start (the Spark session, spark-submit, `delay-sidecar audit`) compiles with C1
# only: a test's audit is short, and C2's compiler threads took a third of its CPU (160 s against
# 105 s for two audits of the test world; the suite's two workers share two cores). Spark's own
# settings stay its defaults.
if "TieredStopAtLevel" not in os.environ.get("SPARK_SUBMIT_OPTS", ""):
    os.environ["SPARK_SUBMIT_OPTS"] = f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} -XX:TieredStopAtLevel=1".strip()
# So does every Apache Kafka node the tests start (KAFKA_OPTS, as the release's scripts read it): the
# suite starts dozens, and a quiet machine spent 4.5 s of CPU on a node's start and stop with C2, 2.4 s
# without. CPU, not waiting, is what bounds the suite's time on two cores.
if "TieredStopAtLevel" not in os.environ.get("KAFKA_OPTS", ""):
    os.environ["KAFKA_OPTS"] = f"{os.environ.get('KAFKA_OPTS', '')} -XX:TieredStopAtLevel=1".strip()


SPARK_SESSION_FILES = "tests/spark/"
"""The tests that share one worker's SparkSession: one unit of work (one JVM warmed up once)."""
OWN_UNITS = ("tests/spark/test_audit_cli.py",)
"""Spark tests that start JVMs of their own instead: a unit each, on another worker."""
LONGEST_FIRST = (
    "tests/test_chaos.py",
    "spark",
    "tests/test_faults.py",
    "tests/failover/test_failover.py",
    "tests/test_keyed.py",
    "tests/test_one_fate.py",
    "tests/control/test_cancel.py",
    "tests/spark/test_audit_cli.py",
    "tests/broker/test_apache.py",
    "tests/test_topic_removal.py",
    "tests/control/test_nack_flow.py",
    "tests/test_exactly_once.py",
    "tests/test_checkpoint.py",
    "tests/dispatch/test_payload_cache_broker.py",
    "tests/test_engine.py",
    "tests/tracker/test_recovery_broker.py",
    "tests/test_state_topic.py",
    "tests/inbound/test_decide_once.py",
    "tests/bench/test_e2e_quick.py",
    "tests/test_supervisor.py",
    "tests/bench/test_nack_backlog.py",
    "tests/policy/test_headers_fuzz.py",
)
"""The units of work that took longest in CI runs here, longest first: the heavy ones (HEAVY) and
the long light ones, which wait on timers, rebalances and restarts far more than they compute, so
that they run beside the heavy ones and not after them. They are handed out before the rest: xdist
orders units by their number of tests, so a long file of three tests (the chaos run) started last
and the suite waited on it. The rest follow in collection order."""


HEAVY = frozenset(
    {
        "tests/failover/test_failover.py",
        "spark",
        "tests/spark/test_audit_cli.py",
        "tests/test_chaos.py",
        "tests/test_faults.py",
        "tests/bench/test_e2e_quick.py",
    }
)
"""Units that start a cluster, JVMs or several sidecars and brokers of their own."""
HEAVY_AT_ONCE = 2


def work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "spark" if path.startswith(SPARK_SESSION_FILES) and path not in OWN_UNITS else path


class _SparkTogether(LoadFileScheduling):
    """A test file per unit of work, as `--dist loadfile`, except that the Spark test files that
    share a session are one unit: one worker's SparkSession (one JVM warmed up once, not one per
    worker). Units are handed out in the order of the collection (see LONGEST_FIRST)."""

    def __init__(self, config: pytest.Config, log: object) -> None:
        super().__init__(config, log)  # type: ignore[arg-type]
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)

    def _reschedule(self, node: WorkerController) -> None:
        """A worker is given its next unit once its last test is the only one left (which it holds
        until it knows what follows), not two tests before as xdist does: a unit given that early
        waited behind the worker's last tests, two churn runs of 2 minutes each, while other
        workers ran out of work."""
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)

    def _assign_work_unit(self, node: object) -> None:
        """The next unit in order, unless HEAVY_AT_ONCE heavy units are running already: then the
        next light one, if any is left. On two cores, the 3-node cluster, the Spark session, the
        audit CLI's JVMs and the chaos run starting together had pushed the load average to 60-90."""
        running = sum(
            1
            for work in self.assigned_work.values()
            for unit, tests in work.items()
            if unit in HEAVY and not all(tests.values())
        )
        if running >= HEAVY_AT_ONCE:
            light = next((unit for unit in self.workqueue if unit not in HEAVY), None)
            if light is not None:
                self.workqueue.move_to_end(light, last=False)
        super()._assign_work_unit(node)


BROKER_FIXTURES = frozenset({"kafka", "embedded_broker", "topic_factory", "kafka_helper"})
STARTS_ITS_OWN = (
    "tests/failover/",
    "tests/spark/",
    "tests/bench/test_e2e_quick.py",
    "tests/bench/test_group_join.py",
    "tests/bench/test_nack_backlog.py",
    "tests/broker/test_apache.py",
    "tests/broker/test_embedded.py",
    "tests/broker/test_orphans.py",
    "tests/test_chaos.py",
    "tests/test_faults.py",
)
"""Test files that start brokers, clusters or Spark JVMs of their own, not through the fixtures."""


def needs_a_broker(item: pytest.Item) -> bool:
    """A test that uses the run's broker or starts a broker or JVM of its own: not in the fast loop
    (`pytest -m "not broker"`, docs/development.md). The no-broker tests that start only a brief
    child process (the CLI's, a sidecar that fails at once) stay in it."""
    path = item.nodeid.split("::", 1)[0]
    return bool(BROKER_FIXTURES & set(getattr(item, "fixturenames", ()))) or path.startswith(STARTS_ITS_OWN)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if needs_a_broker(item):
            item.add_marker(pytest.mark.broker)
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))  # stable: the rest keep their order


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None
    return _SparkTogether(config, log)


_DESCRIPTION = "DELAY_SIDECAR_TEST_BROKER_DESCRIPTION"
"""Set by the process that started the run's broker, for the workers and the report header."""
_STARTED: list[BrokerLauncher] = []


def pytest_configure(config: pytest.Config) -> None:
    """The controlling process starts the run's Apache Kafka before xdist starts its workers, which
    inherit its address through the environment; the broker stops when this process ends."""
    config.addinivalue_line("markers", "fallback: also run on noida-db, the fallback broker (scripts/test.sh)")
    config.addinivalue_line("markers", "broker: set by the suite on every test that needs a broker or a JVM")
    if broker_kind_of_run() == "noida-db":  # as its operators are told (docs/contract.md), for every sidecar
        os.environ.setdefault("DELAY_SIDECAR_IDLE_FETCH_PAUSE_MS", str(EMBEDDED_IDLE_FETCH_PAUSE_MS))
    if hasattr(config, "workerinput") or os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return
    if "not broker" in (config.option.markexpr or ""):
        return  # the fast loop: no test selected needs it
    if config.option.collectonly or broker_kind_of_run() != "apache-kafka":
        return
    data_dir = Path(tempfile.mkdtemp(prefix="delay-sidecar-test-kafka-"))
    launcher = ApacheKafka(data_dir, port=free_port())
    launcher.start()
    _STARTED.append(launcher)
    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = launcher.bootstrap_servers
    os.environ[_DESCRIPTION] = launcher.description

    def stop() -> None:
        launcher.stop()
        if _FAILED:  # the node's logs outlive a red run: the stalls seen beside busy neighbours left none
            kept = Path(tempfile.gettempdir()) / f"delay-sidecar-test-kafka-logs-{os.getpid()}"
            for log in data_dir.glob("node-*/*.log"):
                (kept / log.parent.name).mkdir(parents=True, exist_ok=True)
                shutil.copy2(log, kept / log.parent.name / log.name)
            print(f"\nthe suite's Kafka node's logs: {kept}", file=sys.stderr)
        shutil.rmtree(data_dir, ignore_errors=True)

    config.add_cleanup(stop)


_FAILED: list[bool] = []
"""Set when the run ends red, for the broker's cleanup (pytest_configure) to keep its logs."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus != 0:
        _FAILED.append(True)


def pytest_report_header(config: pytest.Config) -> str:
    if os.environ.get(_DESCRIPTION):
        return f"broker: {os.environ[_DESCRIPTION]} at {os.environ['KAFKA_BOOTSTRAP_SERVERS']}"
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return f"broker: an external cluster at {os.environ['KAFKA_BOOTSTRAP_SERVERS']}"
    return f"broker: {broker_kind_of_run()}, one per worker"


_LAUNCHER: list[BrokerLauncher] = []


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    launcher: BrokerLauncher
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        launcher = ExternalBroker(os.environ["KAFKA_BOOTSTRAP_SERVERS"])
    else:
        launcher = EmbeddedBroker(tmp_path_factory.mktemp("broker"), port=free_port())
    _LAUNCHER.append(launcher)
    with launcher:
        yield launcher.bootstrap_servers


@pytest.fixture
def embedded_broker(kafka: str) -> bool:
    """True when the tests run against noida-db, which lacks some of Kafka's checks (see the tests)."""
    return isinstance(_LAUNCHER[0], EmbeddedBroker)


def _metadata_answer(admin: AdminClient) -> str:
    try:
        admin.list_topics(timeout=10)
    except KafkaException as e:
        return f"none ({e.args[0]})"
    return "answered"


@pytest.fixture
def topic_factory(kafka: str) -> Callable[..., str]:
    """Create a topic with a name no other test uses. Within a minute: the suite's node once answered
    nothing for 26 s and more beside a busy neighbour (its controller stalled and fenced it)."""
    admin = AdminClient({"bootstrap.servers": kafka})

    def create(prefix: str = "t", partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        try:
            admin.create_topics([NewTopic(name, partitions, config=config or {})])[name].result(60)
        except TimeoutError:
            # Once, beside a busy neighbour, with nothing to tell the node from the client: which of
            # the two still answers metadata says which was stuck (librdkafka 2.16 lost a restarted
            # node in three of the sidecar's clients, docs/operations/faults.md).
            fresh = AdminClient({"bootstrap.servers": kafka})
            raise AssertionError(
                f"creating {name} took more than 60 s; metadata from this admin client: "
                f"{_metadata_answer(admin)}, from a new one: {_metadata_answer(fresh)}"
            ) from None
        return name

    return create


@pytest.fixture
def kafka_helper(kafka: str) -> Iterator[KafkaHelper]:
    helper = KafkaHelper(kafka)
    yield helper
    helper.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_ms=1_700_000_000_000)


@pytest.fixture
def policy_file(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str) -> Path:
        path = tmp_path / "policies.yaml"
        path.write_text(text)
        return path

    return write
