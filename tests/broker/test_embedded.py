"""The embedded broker: starts, answers, keeps its data across restarts, stops on SIGTERM."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer

from sidecar.broker.base import wait_for_metadata
from sidecar.broker.embedded import EmbeddedBroker, free_port
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
        [sys.executable, "-m", "sidecar", "broker", "--port", str(port), "--data-dir", str(tmp_path)],
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
