"""Producing and reading records in tests, and running the sidecar on a thread or as a process."""

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from bench import probe
from sidecar.app import SidecarApp
from sidecar.broker import BrokerLauncher, local_broker
from sidecar.broker.base import wait_for_metadata
from sidecar.broker.lifeline import die_with_parent
from sidecar.broker.ports import free_port
from sidecar.clock import Clock
from sidecar.outbound.records import (
    DELIVER_AT,
    ORIGIN,
    ORIGIN_OFFSET,
    ORIGIN_PARTITION,
    ORIGIN_TOPIC,
    REDELIVERY_COUNT,
    read_delivery,
)
from sidecar.settings import RunSettings

ROOT = Path(__file__).resolve().parent.parent
TopicFactory = Callable[..., str]
"""The `topic_factory` fixture: creates a topic no other test uses."""
PolicyFile = Callable[[str], Path]
"""The `policy_file` fixture: writes a policy YAML and returns its path."""


@dataclass
class Received:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    """As written, except that a delivery in the compact form also gets the v1 form's origin and count
    (`as_v1`): tests compare fates whatever the form; tests/outbound and the engine tests check the form."""
    timestamp: int
    received_ms: int
    wire: list[tuple[str, bytes]] | None = None
    """The headers exactly as written."""

    def header_int(self, name: str) -> int:
        return int(self.headers[name])


class KafkaHelper:
    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})

    def produce(
        self,
        topic: str,
        value: bytes,
        key: bytes | None = None,
        headers: list[tuple[str, Any]] | None = None,
        partition: int = -1,
        timestamp: int = 0,
    ) -> None:
        while True:
            try:
                self.producer.produce(
                    topic, value, key, headers=headers or [], partition=partition, timestamp=timestamp
                )
                return
            except BufferError:  # the local queue is full (hundreds of thousands of records): let it drain
                self.producer.poll(0.1)

    def flush(self) -> None:
        assert self.producer.flush(30) == 0

    def read(self, topic: str, count: int, timeout_s: float = 30.0, extra_s: float = 0.0) -> list[Received]:
        """Read the topic from the start until `count` records came, then `extra_s` more for extras."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"test-{uuid.uuid4().hex}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "topic.metadata.refresh.interval.ms": 500,
            }
        )
        consumer.subscribe([topic])
        out: list[Received] = []
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if len(out) >= count:
                    deadline = min(deadline, time.monotonic() + extra_s)
                    if extra_s <= 0:
                        break
                for m in consumer.consume(1000, 0.2):
                    if m.error() is None:
                        out.append(_received(m))
        finally:
            consumer.close()
        return out

    def read_to_end(self, topic: str, timeout_s: float = 60.0, committed_only: bool = False) -> list[Received]:
        """Every record of every partition up to its high watermark now: no count to wait for, so
        duplicates and strays show up. read_committed (`committed_only`) stops at the stable offset.

        librdkafka's default fetch sizes will do past aborted transactions on both brokers: Apache
        Kafka lists in a fetch only the aborts it covers, and noida-db, which lists earlier ones too
        (tests/broker/test_transactions.py), answers a read from offset 0 with the whole partition
        whatever the limits (up to librdkafka's 100 MB receive.message.max.bytes). Both read 30,000
        of 30,000 commits past 6 aborts of one producer id so."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"test-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed" if committed_only else "read_uncommitted",
            }
        )
        try:
            metadata = consumer.list_topics(topic, timeout=10).topics[topic]
            ends = {}
            for p in metadata.partitions:
                # Asked again while a loaded node answers NOT_LEADER_FOR_PARTITION for a moment (CI).
                low, high = probe.watermark_offsets(consumer, TopicPartition(topic, p))
                if high > low:
                    ends[p] = high
            consumer.assign([TopicPartition(topic, p, 0) for p in ends])
            out: list[Received] = []
            deadline = time.monotonic() + timeout_s
            while ends:
                if time.monotonic() > deadline:  # an OSError: a wait_for asks again
                    raise TimeoutError(f"{topic}: partitions {sorted(ends)} not read to their end in {timeout_s:.0f} s")
                for m in consumer.consume(1000, 0.2):
                    if m.error() is not None:
                        if m.partition() in ends and m.offset() >= ends[m.partition()]:
                            del ends[m.partition()]
                        continue
                    if m.offset() >= ends.get(m.partition(), -1):
                        continue
                    out.append(_received(m))
                    if m.offset() + 1 >= ends[m.partition()]:
                        del ends[m.partition()]
            return out
        finally:
            consumer.close()

    def end_offsets(self, topic: str, partitions: int = 1) -> list[int]:
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "offsets"})
        try:
            return [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)]
        finally:
            consumer.close()

    def close(self) -> None:
        self.producer.flush(10)


def _received(m: Any) -> Received:
    return Received(
        m.topic(),
        m.partition(),
        m.offset(),
        m.key(),
        m.value(),
        as_v1({k: v for k, v in (m.headers() or [])}),
        m.timestamp()[1],
        time.time_ns() // 1_000_000,
        m.headers(),
    )


def as_v1(headers: dict[str, bytes]) -> dict[str, bytes]:
    """`headers` with the v1 origin headers and count added to a compact-form delivery."""
    if ORIGIN not in headers:
        return headers
    d = read_delivery(headers)
    v1 = {ORIGIN_TOPIC: d.topic.encode(), ORIGIN_PARTITION: b"%d" % d.partition, ORIGIN_OFFSET: b"%d" % d.offset,
          REDELIVERY_COUNT: b"%d" % d.redelivery_count}  # fmt: skip
    return {**headers, **v1}


def deliveries(records: list[Received]) -> Counter[tuple[int, int, int]]:
    """Copies per (origin partition, origin offset, redelivery count): a duplicate counts 2."""
    return Counter(
        (int(r.headers[ORIGIN_PARTITION]), int(r.headers[ORIGIN_OFFSET]), int(r.headers.get(REDELIVERY_COUNT, b"0")))
        for r in records
    )


def early(records: list[Received]) -> list[Received]:
    return [r for r in records if r.timestamp < int(r.headers[DELIVER_AT])]


def create_topics(bootstrap: str, names: list[str], partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, partitions) for name in names]).values():
        future.result(60)  # as topic_factory (tests/conftest.py)


class LiveReader:
    """An outbound consumer that keeps reading through the faults (bench.probe.LiveReader), for tests."""

    def __init__(self, bootstrap: str, topics: list[str], partitions: int) -> None:
        self.records: dict[str, list[Received]] = {t: [] for t in topics}
        self._reader = probe.LiveReader(
            bootstrap, topics, partitions, lambda m: self.records[m.topic()].append(_received(m))
        )

    def finish(self, timeout_s: float = 60.0) -> dict[str, list[Received]]:
        assert self._reader.finish(timeout_s), "the live reader did not reach the stable end of each partition"
        return self.records


class MetricMissing(AssertionError):
    """A metric a test looks for is not exported (yet): a failure, never a 0; `wait_for` asks again."""


class HoldableClock:
    """The wall clock, which a test can stop for a while: what must happen before some record's time
    comes (a reschedule, a cancel) then happens before it however long a loaded broker takes to
    answer, and no test has to guess a margin. Released, it is the wall clock again (forward only)."""

    def __init__(self) -> None:
        self._held: int | None = None

    def now_ms(self) -> int:
        return self._held if self._held is not None else time.time_ns() // 1_000_000

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._held = self.now_ms()
        try:
            yield
        finally:
            self._held = None

    def move_to(self, at_ms: int) -> None:
        """Held, stand at `at_ms` instead, once the wall clock has passed it: a held clock never runs
        ahead of the wall clock, by which the tests judge a delivery early."""
        assert self._held is not None and at_ms >= self._held, "move a held clock, forward"
        time.sleep(max(0.0, at_ms / 1000 - time.time()))
        self._held = at_ms


class ThreadedSidecar:
    """The sidecar in this process, for tests that need its metrics or a fake clock."""

    def __init__(self, settings: RunSettings, clock: Clock | None = None) -> None:
        self.app = SidecarApp(settings, clock)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.app.run()
        except BaseException as e:  # surfaced by stop()
            self.error = e

    def __enter__(self) -> "ThreadedSidecar":
        self.thread.start()
        assert self.app.wait_serving(30), f"sidecar did not start: {self.error}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.app.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "sidecar did not stop within 30 s"
        if self.error is not None:
            raise self.error

    def metric(self, name: str, **labels: str) -> float:
        """The sample's value. A missing sample fails: as 0 it would let a misspelt name or label pass."""
        value = self.app.metrics.registry.get_sample_value(name, labels)
        if value is None:
            known = sorted(
                f"{sample.name}{sample.labels}"
                for family in self.app.metrics.registry.collect()
                for sample in family.samples
                if sample.name == name
            )
            raise MetricMissing(f"no sample {name}{labels}; samples of that name: {known or 'none'}")
        return value

    def wait_for_metric(self, name: str, at_least: float = 1.0, timeout_s: float = 60.0, **labels: str) -> float:
        """Wait until the sample exists and reaches `at_least`; its value then. Fails at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.app.metrics.registry.get_sample_value(name, labels)
            if value is not None and value >= at_least:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} is {value}, not >= {at_least} after {timeout_s:.0f} s")
            time.sleep(0.05)


def sidecar_process(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m sidecar run ...` as a child process, for kill -9 tests.

    It dies with the test run (SIGKILL on parent death): a killed pytest must not leave sidecars
    consuming from the shared broker. Its embedded broker, if any, dies with it in turn. `env`:
    variables added to the test's own.
    """
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sidecar", "run", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            preexec_fn=die_with_parent(signal.SIGKILL),  # noqa: PLW1509 - see sidecar/broker/lifeline.py
        )


TAKEOVER_SESSION_MS = 15_000
"""The suite's sidecars' --session-timeout-ms, shorter than the product's 45 s: a member stopped
without leaving the group, or killed, keeps its partitions for its session, and many tests hand
them to another member. On the suite's one broker no follower can hold the group's heartbeats
back, which is what the longer default is for; the failover module, on three nodes, runs the default."""


def settings_for(kafka: str, policies: Path, state_dir: Path, **overrides: Any) -> RunSettings:
    wait_for_metadata(kafka, 60)  # the suite's node has stalled 10 s and more beside a busy neighbour
    values: dict[str, Any] = {
        "bootstrap_servers": kafka,
        "policies": policies,
        "state_dir": state_dir,
        "metrics_port": 0,
        "group_id": f"sidecar-{uuid.uuid4().hex[:8]}",
        "commit_interval_ms": 200,
        "session_timeout_ms": TAKEOVER_SESSION_MS,
    }
    values.update(overrides)
    return RunSettings(**values)


def committed(bootstrap: str, group: str, topic: str, partitions: int) -> list[tuple[int, str | None]]:
    """The group's committed (offset, metadata) per partition; offset -1001 when none."""
    return probe.group_commits(bootstrap, group, topic, partitions)


def accepted_lines(kafka_helper: KafkaHelper, control: str) -> int:
    """Acceptances written to a control topic: an accepted record holds one a line, for a slice of commands."""
    return sum((r.value or b"").count(b'"type":"accepted"') for r in kafka_helper.read_to_end(control))


def settled_control(kafka: str, kafka_helper: KafkaHelper, group: str, control: str, accepted: int) -> bool:
    """`accepted` acceptances written to the control topic (3 partitions), and the group's commit at
    its end: every command judged, and every accepted record read back and committed. At least once
    only: in exactly-once mode a transaction's marker lies past the last commit."""
    if accepted_lines(kafka_helper, control) != accepted:
        return False
    return [max(o, 0) for o, _ in committed(kafka, group, control, 3)] == kafka_helper.end_offsets(control, 3)


def scrape(port: int, name: str, **labels: str) -> float:
    """One sample from a running sidecar's /metrics; fails when the sample is not there."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        metric_name, _, rest = sample.partition("{")
        found = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if metric_name == name and found == wanted:
            return float(value)
    raise MetricMissing(f"metric {name}{{{wanted}}} is not exported")


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll until `condition` holds. A condition that cannot be answered yet (an endpoint not up, a
    metric not exported yet, a broker error) is asked again; an assertion inside it fails the test."""
    deadline = time.monotonic() + timeout_s
    error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (OSError, http.client.HTTPException, MetricMissing, KafkaException) as e:
            # HTTPException: a connect to a port nobody listens on yet can, from an ephemeral port
            # that happens to be that one, reach itself, and read its own request as the answer.
            error = e
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last error: {error})")


class SidecarProcess:
    """`delay-sidecar run` as a child process that can be killed and started again on one state dir."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.log, self.env = args, log, env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "SidecarProcess":
        self.process = sidecar_process(self.args, self.log, self.env)
        return self

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> int:
        """SIGTERM; the exit code (a clean stop is 0)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"sidecar did not stop within 60 s\n{self.tail()}") from None

    def close(self) -> None:
        """Kill it if it still runs (a test that failed), its threads' stacks in its log first: a
        sidecar that hung says where (SIGUSR1, app.run_until_signalled)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            self.process.kill()
            self.process.wait(10)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


def wait_serving(port: int, deadline_s: float = 60.0) -> None:
    """The sidecar on `port` owns partitions: a deliver-at counted from now is not due at intake however
    slowly the process started (a busy CI machine takes seconds to import and join the group)."""
    wait_for(lambda: scrape(port, "delay_sidecar_assigned_partitions") > 0, deadline_s, "the sidecar serving")


def start_serving(sidecar: SidecarProcess, port: int) -> None:
    sidecar.start()
    wait_serving(port)


def run_args(kafka: str, policies: Path, state: Path, port: int, group: str, *extra: str) -> list[str]:
    return ["--bootstrap-servers", kafka, "--policies", str(policies), "--state-dir", str(state),
            "--metrics-port", str(port), "--group-id", group, "--commit-interval-ms", "200",
            "--session-timeout-ms", str(TAKEOVER_SESSION_MS), *extra]  # fmt: skip


def produce_due(kafka_helper: KafkaHelper, topic: str, deliver_at: list[int], partitions: int = 1) -> None:
    for i, at in enumerate(deliver_at):
        kafka_helper.produce(topic, f"v{i}".encode(), headers=[("deliver-at", str(at))], partition=i % partitions)
    kafka_helper.flush()


def outbound_end(kafka_helper: KafkaHelper, topic: str, partitions: int = 1) -> int:
    """Records an outbound consumer can read now (read_committed). Not the sum of the end offsets:
    a transaction's commit marker takes an offset too."""
    return len(kafka_helper.read_to_end(topic, committed_only=True))


def assert_once_each(kafka_helper: KafkaHelper, outbound: str, expected: int) -> None:
    """As an outbound consumer sees it: read_committed, which leaves out aborted transactions."""
    assert_records_once_each(kafka_helper.read_to_end(outbound, committed_only=True), outbound, expected)


def assert_records_once_each(records: list[Received], outbound: str, expected: int) -> None:
    copies = deliveries(records)
    duplicated = {origin: n for origin, n in copies.items() if n > 1}
    some = list(duplicated.items())[:5]
    assert not duplicated, f"{outbound}: {len(duplicated)} records delivered more than once, e.g. {some}"
    assert len(copies) == expected, f"{outbound}: {len(copies)} of {expected} delivered"
    assert not early(records), f"{outbound}: delivered early"


TEST_BROKER = "DELAY_SIDECAR_TEST_BROKER"
"""apache-kafka (default) or noida-db: the broker kind of the run, when KAFKA_BOOTSTRAP_SERVERS names none."""


def broker_kind_of_run() -> Literal["apache-kafka", "noida-db"]:
    kind = os.environ.get(TEST_BROKER, "apache-kafka")
    if kind not in ("apache-kafka", "noida-db"):
        raise pytest.UsageError(f"{TEST_BROKER}={kind}: use apache-kafka or noida-db")
    return "noida-db" if kind == "noida-db" else "apache-kafka"


def own_broker(data_dir: Path) -> BrokerLauncher:
    """A broker of the test's own, to stop and start again: of the run's kind (tests/conftest.py)."""
    return local_broker(broker_kind_of_run(), data_dir, port=free_port())
