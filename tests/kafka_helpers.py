"""Producing and reading records in tests, and running the sidecar on a thread or as a process."""

import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from sidecar.app import SidecarApp
from sidecar.broker.base import wait_for_metadata
from sidecar.broker.lifeline import die_with_parent
from sidecar.settings import RunSettings

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Received:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    timestamp: int
    received_ms: int

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
        self.producer.produce(topic, value, key, headers=headers or [], partition=partition, timestamp=timestamp)

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
                        out.append(
                            Received(
                                m.topic(),
                                m.partition(),
                                m.offset(),
                                m.key(),
                                m.value(),
                                {k: v for k, v in (m.headers() or [])},
                                m.timestamp()[1],
                                time.time_ns() // 1_000_000,
                            )
                        )
        finally:
            consumer.close()
        return out

    def end_offsets(self, topic: str, partitions: int = 1) -> list[int]:
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "offsets"})
        try:
            return [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)]
        finally:
            consumer.close()

    def close(self) -> None:
        self.producer.flush(10)


class ThreadedSidecar:
    """The sidecar in this process, for tests that need its metrics or a fake clock."""

    def __init__(self, settings: RunSettings) -> None:
        self.app = SidecarApp(settings)
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
            raise AssertionError(f"no sample {name}{labels}; samples of that name: {known or 'none'}")
        return value

    def metric_or_zero(self, name: str, **labels: str) -> float:
        """For a labelled counter that appears on its first increment, where "never" is a valid answer."""
        value = self.app.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

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


def sidecar_process(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`python -m sidecar run ...` as a child process, for kill -9 tests.

    It dies with the test run (SIGKILL on parent death): a killed pytest must not leave sidecars
    consuming from the shared broker. Its embedded broker, if any, dies with it in turn.
    """
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sidecar", "run", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            preexec_fn=die_with_parent(signal.SIGKILL),  # noqa: PLW1509 - see sidecar/broker/lifeline.py
        )


def settings_for(kafka: str, policies: Path, state_dir: Path, **overrides: Any) -> RunSettings:
    wait_for_metadata(kafka, 10)
    values: dict[str, Any] = {
        "bootstrap_servers": kafka,
        "policies": policies,
        "state_dir": state_dir,
        "metrics_port": 0,
        "group_id": f"sidecar-{uuid.uuid4().hex[:8]}",
        "commit_interval_ms": 200,
    }
    values.update(overrides)
    return RunSettings(**values)
