"""The embedded broker: starts, answers, keeps its data across restarts, stops on SIGTERM."""

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from sidecar.broker.base import wait_for_metadata
from sidecar.broker.embedded import EmbeddedBroker
from sidecar.broker.ports import free_port
from tests.broker.test_orphans import noida_broker_command
from tests.kafka_helpers import ROOT


def test_data_survives_a_restart(tmp_path: Path) -> None:
    port = free_port()
    with EmbeddedBroker(tmp_path, port=port) as broker:
        producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
        producer.produce("kept", b"hello")
        assert producer.flush(10) == 0
    with EmbeddedBroker(tmp_path, port=port) as broker:
        consumer = Consumer(
            {"bootstrap.servers": broker.bootstrap_servers, "group.id": "g", "auto.offset.reset": "earliest"}
        )
        consumer.subscribe(["kept"])
        values = []
        deadline = time.monotonic() + 15
        while not values and time.monotonic() < deadline:
            values = [m.value() for m in consumer.consume(10, 0.5) if m.error() is None]
        consumer.close()
    assert values == [b"hello"]


def test_broker_command_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        noida_broker_command(port, tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_metadata(f"127.0.0.1:{port}", timeout_s=30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()
    # The broker child went with it: the port is free again.
    with EmbeddedBroker(tmp_path, port=port):
        pass


def test_writes_acknowledged_while_the_broker_stops_survive_its_restart(tmp_path: Path) -> None:
    """Issue 12: on SIGTERM noida-db kept acknowledging writes while it saved, and lost them.

    The data dir is preloaded so the save takes a while, as on a data dir that has been in use.
    """
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    acked: set[int] = set()
    broker = EmbeddedBroker(tmp_path, port=port)
    broker.start()
    try:
        ballast = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
        for _ in range(20_000):
            while True:
                try:
                    ballast.produce("ballast", b"x" * 1000)
                    break
                except BufferError:
                    ballast.poll(0.05)
        assert ballast.flush(120) == 0
        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 5000})

        def on_delivery(error: object, message: Any) -> None:
            if error is None:
                acked.add(int(message.value()))

        stop = threading.Event()

        def produce() -> None:
            number = 0
            while not stop.is_set():
                producer.produce("acked", str(number).encode(), on_delivery=on_delivery)
                number += 1
                producer.poll(0.001)

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while len(acked) < 1000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(acked) >= 1000, "the producer never got going"
    finally:
        broker.stop()
    stop.set()
    thread.join(60)
    producer.flush(30)
    with EmbeddedBroker(tmp_path, port=port):
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "check", "enable.auto.commit": False})
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition("acked", 0), timeout=10)
            consumer.assign([TopicPartition("acked", 0, 0)])
            stored: set[int] = set()
            deadline = time.monotonic() + 60
            while len(stored) < high and time.monotonic() < deadline:
                stored.update(int(m.value()) for m in consumer.consume(10_000, 0.5) if m.error() is None)
        finally:
            consumer.close()
    assert sorted(acked - stored) == []
