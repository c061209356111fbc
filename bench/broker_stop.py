"""How many acknowledged writes the embedded broker loses when it is stopped under load.

Usage: .venv/bin/python -m bench.broker_stop [--via direct|service|cli] [--signal TERM|INT] [--runs 3]
                                             [--rate 2000] [--before-s 2] [--preload-mb 0]

Each run starts a fresh broker, produces numbered records with acks=all at a steady rate, stops the
broker with the signal while the producer keeps going, restarts it on the same data dir and counts
the acknowledged records that are not in the topic. `--via direct` signals noida-db itself;
`--via service` runs `noida-db stop kafka` first, as the launcher now does; `--via cli` signals
`delay-sidecar broker`, which then stops its noida-db child. The numbers are quoted in the README's
embedded-broker section. How much an unordered stop loses depends on the rate and the data size, so
it is measured here; tests/broker only asserts that nothing acknowledged is lost.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from sidecar.broker.base import wait_for_metadata
from sidecar.broker.embedded import EmbeddedBroker, noida_binary
from sidecar.broker.lifeline import die_with_parent
from sidecar.broker.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TOPIC = "loss"


@dataclass
class Outcome:
    via: str
    signal: str
    produced: int
    acked: int
    lost: int
    stop_s: float
    exit_code: int | None
    lost_acked_from_s: float | None
    lost_acked_to_s: float | None


class SteadyProducer:
    """Numbered records at a fixed rate on a thread; remembers which ones the broker acknowledged."""

    def __init__(self, bootstrap: str, rate: int) -> None:
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "acks": "all",
                "linger.ms": 5,
                # Records the broker never acknowledged fail fast, so they are not counted as acked.
                "message.timeout.ms": 5000,
                "log_level": 0,
            }
        )
        self._rate = rate
        self._stop = threading.Event()
        self.produced = 0
        self.acked: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _on_delivery(self, error: KafkaError | None, message: Any) -> None:
        if error is None:
            self.acked[int(message.value())] = time.monotonic()

    def _run(self) -> None:
        began = time.monotonic()
        while not self._stop.is_set():
            due = int((time.monotonic() - began) * self._rate)
            while self.produced < due:
                try:
                    self._producer.produce(TOPIC, str(self.produced).encode(), on_delivery=self._on_delivery)
                except BufferError:
                    break
                self.produced += 1
            self._producer.poll(0.005)

    def finish(self) -> None:
        self._stop.set()
        self._thread.join()
        self._producer.flush(15)


def start_broker(via: str, data_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    if via in ("direct", "service"):
        argv = [str(noida_binary()), "start", "--data-dir", str(data_dir), "--only", "kafka"]
        argv += ["--kafka-port", str(port)]
    else:
        argv = [sys.executable, "-m", "sidecar", "broker", "--port", str(port), "--data-dir", str(data_dir)]
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - see sidecar/broker/lifeline.py
        )


def read_all(bootstrap: str) -> set[int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"loss-{uuid.uuid4().hex}", "log_level": 0})
    try:
        partition = TopicPartition(TOPIC, 0)
        _, high = consumer.get_watermark_offsets(partition, timeout=10)
        partition.offset = 0
        consumer.assign([partition])
        seen: set[int] = set()
        position = 0
        deadline = time.monotonic() + 60
        while position < high and time.monotonic() < deadline:
            for m in consumer.consume(10_000, 0.5):
                if m.error() is None:
                    seen.add(int(m.value()))
                    position = m.offset() + 1
        return seen
    finally:
        consumer.close()


def preload(bootstrap: str, megabytes: int) -> None:
    """Data from earlier runs: the broker's save at stop, and so the loss window, grows with it."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "log_level": 0})
    value = b"x" * 1024
    for _ in range(megabytes * 1024):
        while True:
            try:
                producer.produce("ballast", value)
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(120) != 0:
        raise RuntimeError("preloading the broker did not finish in 120 s")


def one_run(via: str, signame: str, rate: int, before_s: float, preload_mb: int, work: Path) -> Outcome:
    data_dir = work / f"broker-{uuid.uuid4().hex[:6]}"
    data_dir.mkdir()
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    process = start_broker(via, data_dir, port, work / "broker.log")
    try:
        wait_for_metadata(bootstrap, timeout_s=30)
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(TOPIC, 1)])[TOPIC].result(10)
        preload(bootstrap, preload_mb)
        producer = SteadyProducer(bootstrap, rate)
        producer.start()
        time.sleep(before_s)
        began = time.monotonic()
        if via == "service":
            subprocess.run([str(noida_binary()), "stop", "kafka", "--data-dir", str(data_dir)], check=True)
        process.send_signal(getattr(signal, f"SIG{signame}"))
        exit_code = process.wait(60)
        stop_s = time.monotonic() - began
        producer.finish()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with EmbeddedBroker(data_dir, port=port):
        seen = read_all(bootstrap)
    lost = [at - began for number, at in producer.acked.items() if number not in seen]
    return Outcome(
        via,
        signame,
        producer.produced,
        len(producer.acked),
        len(lost),
        round(stop_s, 3),
        exit_code,
        round(min(lost), 3) if lost else None,
        round(max(lost), 3) if lost else None,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--via", choices=["direct", "service", "cli"], default="cli")
    parser.add_argument("--signal", choices=["TERM", "INT"], default="TERM")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=int, default=2000, help="records per second")
    parser.add_argument("--before-s", type=float, default=2.0, help="seconds of load before the stop")
    parser.add_argument("--preload-mb", type=int, default=0, help="data written to another topic first")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="broker-stop-") as tmp:
        for _ in range(args.runs):
            outcome = one_run(args.via, args.signal, args.rate, args.before_s, args.preload_mb, Path(tmp))
            print(json.dumps(asdict(outcome)), flush=True)


if __name__ == "__main__":
    main()
