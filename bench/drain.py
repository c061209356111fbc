"""How long a topic removal holds up the other topics: the drain of 1M pending records, a slice per turn.

Usage: .venv/bin/python -m bench.drain [--pending 1000000] [--partitions 2] [--rate 1000] [--json FILE]

A topic with `--pending` records delayed by an hour, and a kept topic fed `--rate` records/s due one
second after they are produced, are served by one sidecar (in this process, on a broker of its own:
Apache Kafka; DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback's figures). Once the kept topic
delivers, the first topic leaves the policies: its pending records go
to its dead-letter topic with TOPIC_REMOVED (sidecar/dispatch/drain.py), while the kept topic's
records keep falling due. Measured:

- the drain's slice per loop turn (time inside `Drains.turn`): the target is <= 100 ms;
- the loop's period while draining (from one slice to the next: the slice plus intake, dispatch
  and checkpoints), which is what a kept record due meanwhile can wait at most;
- the kept topic's lateness (outbound timestamp - deliver-at) before and during the drain;
- the drain's length and rate, and that the dead-letter topic got each pending record once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, Producer, TopicPartition

from bench import load
from bench.probe import create_topic
from bench.procs import bench_broker
from bench.report import command_line, dated_lines
from sidecar.app import SidecarApp
from sidecar.dispatch import drain
from sidecar.outbound.records import DELIVER_AT, ORIGIN_OFFSET, ORIGIN_PARTITION
from sidecar.settings import RunSettings

REMOVED, KEPT = "drain.removed", "drain.kept"
HOUR_MS = 3_600_000
TARGET_SLICE_MS = 100.0


def policy(*topics: str) -> str:
    return "topics:\n" + "".join(f"  {t}:\n    subscriptions: {{a: {{}}}}\n" for t in topics)


class TurnClock:
    """Wraps `Drains.turn`: how long each slice took, and the time from one to the next."""

    def __init__(self) -> None:
        self.slices_ms: list[float] = []
        self.periods_ms: list[float] = []
        self.recording = False
        self._last: float | None = None
        original = drain.Drains.turn

        def timed(drains: drain.Drains, slice_s: float = drain.DRAIN_SLICE_S) -> None:
            started = time.perf_counter()
            try:
                original(drains, slice_s)
            finally:
                if self.recording and drains.busy:
                    self.slices_ms.append((time.perf_counter() - started) * 1000)
                    if self._last is not None:
                        self.periods_ms.append((started - self._last) * 1000)
                    self._last = started
                else:
                    self._last = None

        drain.Drains.turn = timed  # type: ignore[method-assign,assignment]


class KeptLoad:
    """Records due one second after they are produced, at a steady rate, until stopped."""

    def __init__(self, bootstrap: str, rate: int, topic: str = KEPT) -> None:
        self._topic = topic
        self._producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self._rate = rate
        self._stop = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            while self.sent < int((time.monotonic() - started) * self._rate):
                at = time.time_ns() // 1_000_000 + 1_000
                self._producer.produce(self._topic, b"k", headers=[("deliver-at", b"%d" % at)])
                self.sent += 1
            self._producer.poll(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self._producer.flush(60)
        return self.sent


def read_all(bootstrap: str, topic: str, take: Callable[[Any], None]) -> None:
    """Every record of `topic` up to its high watermarks, to `take`."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"drain-{time.time_ns()}",
                         "enable.auto.commit": False})  # fmt: skip
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        ends = {p: end for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        while ends:
            for m in consumer.consume(10_000, 0.5):
                if m.error() is None and m.offset() < ends.get(m.partition(), -1):
                    take(m)
                    if m.offset() == ends[m.partition()] - 1:
                        del ends[m.partition()]
    finally:
        consumer.close()


Sample = Callable[..., float]
"""sample(metric name, **labels): the sidecar's metric now, 0 when it has no such sample yet."""


def serve(settings: RunSettings) -> tuple[SidecarApp, threading.Thread, Sample]:
    """The sidecar in this process, on a thread of its own, and a reader of its metrics."""
    app = SidecarApp(settings)
    thread = threading.Thread(target=app.run, daemon=True)
    thread.start()
    registry = app.metrics.registry

    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    return app, thread, sample


def lateness(bootstrap: str, outbound: str, start_ms: int, end_ms: int) -> tuple[list[float], list[float]]:
    """Lateness (outbound timestamp - deliver-at, ms) of the records of `outbound` due before
    `start_ms`, and of those due from then until `end_ms`."""
    before: list[float] = []
    during: list[float] = []

    def take(m: Any) -> None:
        at = int(dict(m.headers())[DELIVER_AT])
        late = float(m.timestamp()[1] - at)
        if at < start_ms:
            before.append(late)
        elif at <= end_ms:
            during.append(late)

    read_all(bootstrap, outbound, take)
    return before, during


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def wait(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - started


def run(bootstrap: str, work: Path, pending: int, partitions: int, rate: int) -> dict[str, Any]:
    clock = TurnClock()
    create_topic(bootstrap, REMOVED, partitions)
    create_topic(bootstrap, KEPT, 1)
    base = time.time_ns() // 1_000_000 + HOUR_MS
    load.produce(bootstrap, REMOVED, pending, mode="deliver-at", base_ms=base, window_ms=60_000)
    policies = work / "policies.yaml"
    policies.write_text(policy(REMOVED, KEPT))
    settings = RunSettings(bootstrap_servers=bootstrap, policies=policies, state_dir=work / "state",
                           metrics_port=0, group_id="drain-bench")  # fmt: skip
    app, thread, sample = serve(settings)
    intake_s = wait(lambda: sample("delay_sidecar_messages_delayed_total", topic=REMOVED) >= pending,
                    900, "intake of the pending records")  # fmt: skip
    kept = KeptLoad(bootstrap, rate)
    wait(lambda: sample("delay_sidecar_messages_delivered_total", topic=KEPT, subscription="a") > 0, 60,
         "the kept topic delivering")  # fmt: skip
    time.sleep(5)  # the baseline: the kept topic's lateness without a drain
    clock.recording = True
    removed_ms = time.time_ns() // 1_000_000
    policies.write_text(policy(KEPT))
    app.reload_policies()
    labels = {"topic": REMOVED, "namespace": "", "code": drain.TOPIC_REMOVED}
    drain_s = wait(lambda: sample("delay_sidecar_messages_delayed_rejected_total", **labels) >= pending, 900,
                   "the drain")  # fmt: skip
    drained_ms = time.time_ns() // 1_000_000
    clock.recording = False
    time.sleep(2)
    sent = kept.stop()
    wait(lambda: sample("delay_sidecar_messages_delivered_total", topic=KEPT, subscription="a") >= sent, 60,
         "the kept topic's last records")  # fmt: skip
    app.stop()
    thread.join(60)

    dead: Counter[tuple[int, int]] = Counter()
    read_all(bootstrap, f"{REMOVED}.dlt", lambda m: dead.update([_origin(m)]))
    before, during = lateness(bootstrap, f"{KEPT}.a", removed_ms, drained_ms)
    return {
        "pending": pending,
        "partitions": partitions,
        "kept_rate": rate,
        "intake_s": round(intake_s, 1),
        "drain_s": round(drain_s, 2),
        "drain_rate": round(pending / drain_s),
        "dead_letters": sum(dead.values()),
        "dead_letters_distinct": len(dead),
        "turns": len(clock.slices_ms),
        "slice_ms_p50": _r(quantile(clock.slices_ms, 0.5)),
        "slice_ms_p99": _r(quantile(clock.slices_ms, 0.99)),
        "slice_ms_max": _r(max(clock.slices_ms, default=None)),
        "period_ms_p50": _r(quantile(clock.periods_ms, 0.5)),
        "period_ms_p99": _r(quantile(clock.periods_ms, 0.99)),
        "period_ms_max": _r(max(clock.periods_ms, default=None)),
        "kept_late_ms_before_p99": _r(quantile(before, 0.99)),
        "kept_late_ms_before_max": _r(max(before, default=None)),
        "kept_late_ms_during_p99": _r(quantile(during, 0.99)),
        "kept_late_ms_during_max": _r(max(during, default=None)),
        "kept_early": sum(1 for late in before + during if late < 0),
        "kept_records_during": len(during),
    }


def _origin(m: Any) -> tuple[int, int]:
    """Of a dead letter: they keep the v1 origin headers."""
    h = dict(m.headers())
    return int(h[ORIGIN_PARTITION]), int(h[ORIGIN_OFFSET])


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.drain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000, metavar="N", help="records of the removed topic")
    parser.add_argument("--partitions", type=int, default=2, metavar="N", help="partitions of the removed topic")
    parser.add_argument("--rate", type=int, default=1_000, metavar="R", help="kept topic records/s")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp, bench_broker(Path(tmp) / "broker") as broker:
        dated = dated_lines(broker, command_line("bench.drain", argv))
        result = run(broker.bootstrap_servers, Path(tmp), args.pending, args.partitions, args.rate)
    print(dated + "\n")
    width = max(len(k) for k in result)
    print(f"| {'measure':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for key, value in result.items():
        print(f"| {key:<{width}} | {value} |")
    met = (
        result["slice_ms_max"] is not None
        and result["slice_ms_max"] <= TARGET_SLICE_MS
        and result["dead_letters"] == result["dead_letters_distinct"] == args.pending
        and result["kept_early"] == 0
    )
    print(f"target: slice per turn <= {TARGET_SLICE_MS:.0f} ms, each pending record dead-lettered once, "
          f"nothing early: {'met' if met else 'MISSED'}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
