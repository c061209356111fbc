"""`delay-sidecar demo`: broker, sidecar, a producer and a consumer, live, in under a minute.

It runs on a fresh local broker (Apache Kafka where it can run, else noida-db) in a temporary
directory, with the example policies, and prints each record as it arrives on an outbound topic
with its lateness after deliver-at.
"""

import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Consumer, Producer

from sidecar.app import SidecarApp, idle_fetch_pause_ms
from sidecar.broker.local import BrokerKind, local_broker
from sidecar.broker.ports import free_port
from sidecar.errors import ConfigError, SidecarError
from sidecar.kafka_io import LIBRDKAFKA
from sidecar.outbound.records import DELIVER_AT, ERROR_CODE
from sidecar.policy import load_policies
from sidecar.settings import RunSettings

DEMO_TOPIC = "orders"
TIMEOUT_S = 40.0


def run_demo(
    policies: Path, records: int = 6, write: Callable[[str], None] = print, broker_kind: BrokerKind = "auto"
) -> int:
    """Returns 0 when every record arrived on every subscription and none early."""
    route = load_policies(policies).topics.get(DEMO_TOPIC)
    if route is None or not route.subscriptions:
        raise ConfigError(
            f"{policies}: the demo needs topic '{DEMO_TOPIC}' with subscriptions; see policies/example.yaml"
        )
    with tempfile.TemporaryDirectory(prefix="delay-sidecar-demo-") as tmp:
        broker = local_broker(broker_kind, Path(tmp) / "broker", port=free_port())
        with broker:
            write(f"broker   {broker.description} at {broker.bootstrap_servers}")
            settings = RunSettings(
                bootstrap_servers=broker.bootstrap_servers,
                policies=policies,
                state_dir=Path(tmp),
                metrics_port=0,
                group_id="delay-sidecar-demo",
                commit_interval_ms=200,
                idle_fetch_pause_ms=idle_fetch_pause_ms(None, broker),
            )
            app = SidecarApp(settings)
            thread = threading.Thread(target=app.run, name="sidecar", daemon=True)
            thread.start()
            try:
                if not app.wait_serving(30):
                    write("FAILED: the sidecar did not start serving within 30 s")
                    return 1
                return _produce_and_watch(
                    broker.bootstrap_servers,
                    route.dead_letter_topic,
                    [s.outbound for s in route.subscriptions],
                    records,
                    write,
                )
            finally:
                app.stop()
                thread.join(timeout=30)


def _produce_and_watch(
    bootstrap: str, dead_letter: str, outbounds: list[str], count: int, out: Callable[[str], None]
) -> int:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"demo-watch-{time.time_ns()}", "auto.offset.reset": "earliest"},
        logger=LIBRDKAFKA,
    )
    consumer.subscribe([*outbounds, dead_letter])
    producer = Producer({"bootstrap.servers": bootstrap}, logger=LIBRDKAFKA)
    delays = [0, *sorted(random.sample(range(1, 11), k=min(count - 1, 10)))]
    start = time.time()
    sent: dict[int, str] = {}
    for i, seconds in enumerate(delays):
        delay = [("deliver-after", f"{seconds}s")] if seconds else []
        producer.produce(DEMO_TOPIC, f"order {i}".encode(), f"order-{i}".encode(), headers=delay)
        sent[i] = f"deliver-after {seconds}s" if seconds else "no delay"
    producer.produce(DEMO_TOPIC, b"bad order", b"order-bad", headers=[("deliver-after", b"soon")])
    producer.flush(10)
    out(f"produced {len(sent)} records to '{DEMO_TOPIC}' with delays of 0-10 s, and 1 with a bad header")
    expected = len(sent) * len(outbounds) + 1
    seen, early = 0, 0
    deadline = time.time() + TIMEOUT_S
    while seen < expected and time.time() < deadline:
        record = consumer.poll(0.2)
        if record is None or record.error() is not None:
            continue
        headers = dict(record.headers() or [])
        elapsed = time.time() - start
        if record.topic() == dead_letter:
            out(
                f"[+{elapsed:5.2f}s] {record.topic():<18} key={record.key().decode():<10} "
                f"rejected: {headers.get(ERROR_CODE, b'').decode()}"
            )
        else:
            lateness = record.timestamp()[1] - int(headers[DELIVER_AT])
            early += lateness < 0
            origin = int(record.key().decode().removeprefix("order-"))
            out(
                f"[+{elapsed:5.2f}s] {record.topic():<18} key={record.key().decode():<10} "
                f"{sent.get(origin, '?'):<18} lateness {lateness:4d} ms"
            )
        seen += 1
    consumer.close()
    ok = seen == expected and early == 0
    out(f"{'done' if ok else 'FAILED'}: {seen}/{expected} records arrived, {early} early")
    return 0 if ok else 1


__all__ = ["SidecarError", "run_demo"]
