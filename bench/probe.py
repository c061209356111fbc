"""Observing a run from outside: high watermarks, the sidecar's metrics, resident memory, outbound records.

Everything here reads; nothing writes to the topics under test. The sidecar and the relay run in
processes of their own, so what is sampled here costs them no GIL time (only the metrics scrape
runs on the sidecar's HTTP thread, a few times a second).
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil  # type: ignore[import-untyped,unused-ignore]
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from sidecar.client_cancel import watermark_offsets

DELIVER_AT = "delay-deliver-at"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def group_commits(
    bootstrap: str, group: str, topic: str, partitions: int, stable: bool = True
) -> list[tuple[int, str | None]]:
    """The group's committed (offset, metadata) per partition of `topic` (an OffsetFetch only: this
    consumer never joins the group); offset -1001 where none is. `stable`: wait, up to 10 s, for a
    transaction that holds newer offsets of the group (KIP-447); else the last committed at once."""
    isolation = "read_committed" if stable else "read_uncommitted"
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False, "isolation.level": isolation}
    )
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], 10)
        return [(tp.offset, tp.metadata) for tp in found]
    finally:
        consumer.close()


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    """Created, and led: Apache Kafka tells its brokers of a new topic after it has answered."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions)])[name].result(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        topic = admin.list_topics(name, timeout=10).topics.get(name)
        if topic is not None and topic.error is None and all(p.leader >= 0 for p in topic.partitions.values()):
            return
        time.sleep(0.1)


class Watermarks:
    """Sum of high watermarks of whole topics: how many records they hold (nothing is deleted here)."""

    def __init__(self, bootstrap: str) -> None:
        self._consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": f"bench-watermarks-{uuid.uuid4().hex[:8]}"}
        )
        self._partitions: dict[str, int] = {}

    def partitions(self, topic: str) -> int:
        if topic not in self._partitions:
            deadline = time.monotonic() + 30
            while True:
                metadata = self._consumer.list_topics(topic, timeout=10).topics.get(topic)
                if metadata is not None and metadata.error is None and metadata.partitions:
                    self._partitions[topic] = len(metadata.partitions)
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"topic {topic} has no metadata after 30 s")
                time.sleep(0.2)
        return self._partitions[topic]

    def total(self, topic: str) -> int:
        return sum(self.ends(topic))

    def ends(self, topic: str) -> list[int]:
        return [self._end(TopicPartition(topic, p)) for p in range(self.partitions(topic))]

    def _end(self, partition: TopicPartition) -> int:
        return watermark_offsets(self._consumer, partition)[1]

    def close(self) -> None:
        self._consumer.close()


@dataclass
class Progress:
    """When outbound topics first got a record and when they held every expected record."""

    first_s: float | None = None
    done_s: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    first_counts: float = 0.0
    """Records per topic (mean over the topics) already there at first_s."""

    @property
    def completed(self) -> bool:
        return self.done_s is not None

    def rate(self, expected: int) -> float | None:
        """Records/s per topic from the first poll that saw records to the one that saw them all.

        Counted from the records already there at the first poll rather than from zero: a fast
        relay writes many between two polls, and crediting them to the interval after made its
        rate look several times too high at small sizes. None when every record came in one poll.
        """
        if self.first_s is None or self.done_s is None or self.done_s <= self.first_s:
            return None
        carried = expected - self.first_counts
        return carried / (self.done_s - self.first_s) if carried > 0 else None


def wait_for_outbound(
    watermarks: Watermarks,
    topics: list[str],
    expected: int,
    timeout_s: float,
    poll_s: float = 0.05,
    alive: Callable[[], bool] = lambda: True,
    tick: Callable[[], None] = lambda: None,
) -> Progress:
    """Poll until every topic holds `expected` records; times are time.monotonic() values.

    `tick` runs at every poll, for samples taken while the run goes on (the cache's disk use).
    """
    progress = Progress()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        counts = {topic: watermarks.total(topic) for topic in topics}
        stamp = time.monotonic()
        progress.counts = counts
        if progress.first_s is None and any(counts.values()):
            progress.first_s = stamp
            progress.first_counts = sum(counts.values()) / len(counts)
        if all(n >= expected for n in counts.values()):
            progress.done_s = stamp
            return progress
        tick()
        time.sleep(poll_s)
    return progress


class RssSampler:
    """Peak resident memory of one process (and its children), sampled on a thread."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self._process = psutil.Process(pid)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_bytes = 0
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self._process.memory_info().rss
                for child in self._process.children(recursive=True):
                    rss += child.memory_info().rss
            except psutil.Error:
                return
            self.peak_bytes = max(self.peak_bytes, rss)
            self._stop.wait(self._interval_s)

    def stop(self) -> float:
        """Peak RSS in MiB."""
        self._stop.set()
        self._thread.join(5)
        return self.peak_bytes / 2**20


def scrape(port: int, timeout_s: float = 2.0) -> dict[str, float]:
    """The sidecar's Prometheus samples as {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            samples[name] = float(value)
        except ValueError:
            continue
    return samples


def metric_sum(samples: dict[str, float], name: str) -> float:
    """Sum of one metric over all its label sets."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


class MetricsRecorder:
    """Scrapes the sidecar a few times a second: (monotonic time, {metric: value summed over labels})."""

    NAMES = (
        "delay_sidecar_messages_in_total",
        "delay_sidecar_messages_delayed_total",
        "delay_sidecar_messages_delivered_total",
        "delay_sidecar_payload_cache_bytes",
    )
    # Sums over the label sets that contain a label: where the payloads of due records came from.
    PARTS = {
        "payload_reads_cache": ("delay_sidecar_payload_reads_total", 'source="cache"'),
        "payload_reads_log": ("delay_sidecar_payload_reads_total", 'source="log"'),
    }

    def __init__(self, port: int | list[int], interval_s: float = 0.25) -> None:
        """Several ports (the workers of `run --workers N`) are summed into one series."""
        self._ports = [port] if isinstance(port, int) else port
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.series: list[tuple[float, dict[str, float]]] = []
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)

    def start(self) -> MetricsRecorder:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                samples: dict[str, float] = {}
                for port in self._ports:
                    for key, value in scrape(port).items():
                        samples[key] = samples.get(key, 0.0) + value
                values = {n: metric_sum(samples, n) for n in self.NAMES}
                for part, (name, label) in self.PARTS.items():
                    values[part] = sum(v for k, v in samples.items() if k.startswith(name + "{") and label in k)
                self.series.append((time.monotonic(), values))
            except OSError:
                pass
            self._stop.wait(self._interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def rate(self, name: str, target: float) -> float | None:
        """Records/s of a counter from its first non-zero sample to the first sample at `target`.

        Without a sample at `target` (the run ended between scrapes), up to the last sample.
        """
        points = [(t, s[name]) for t, s in self.series]
        first = next(((t, v) for t, v in points if v > 0), None)
        last = next(((t, v) for t, v in points if v >= target), points[-1] if points else None)
        if first is None or last is None or last[0] <= first[0]:
            return None
        return (last[1] - first[1]) / (last[0] - first[0])

    def last(self, name: str) -> float:
        return self.series[-1][1][name] if self.series else 0.0

    def peak(self, name: str) -> float:
        return max((s[name] for _, s in self.series), default=0.0)


@dataclass
class Deliveries:
    """Outbound record timestamps (time of delivery) and their delay-deliver-at headers, epoch ms."""

    delivered_ms: array[int] = field(default_factory=lambda: array("q"))
    deliver_at_ms: array[int] = field(default_factory=lambda: array("q"))


def read_records(bootstrap: str, topic: str, watermarks: Watermarks, timeout_s: float = 300.0) -> Iterator[Message]:
    """Every record of a topic, from the start to its high watermarks (as they are when called)."""
    ends = watermarks.ends(topic)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            # In exactly-once mode a partition ends with a transaction marker, which no record reaches.
            "enable.partition.eof": True,
            # noida-db answers a fetch with the whole rest of each partition: 1M outbound records
            # came back as one 106 MB response, over librdkafka's 100 MB default, and the read stalled.
            "receive.message.max.bytes": 512 * 1024 * 1024,
        }
    )
    remaining = {p: end for p, end in enumerate(ends) if end > 0}
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in remaining])
    deadline = time.monotonic() + timeout_s
    try:
        while remaining and time.monotonic() < deadline:
            for m in consumer.consume(10_000, 0.5):
                partition = m.partition()
                if m.error() is not None:
                    if m.offset() >= remaining.get(partition, m.offset() + 1):
                        remaining.pop(partition, None)  # end of partition: read up to its end
                    continue
                yield m
                if m.offset() + 1 >= remaining.get(partition, 0):
                    remaining.pop(partition, None)
    finally:
        consumer.close()


def read_deliveries(bootstrap: str, topic: str, watermarks: Watermarks, into: Deliveries | None = None) -> Deliveries:
    """Read a whole outbound topic from the start to its high watermarks."""
    out = into or Deliveries()
    delivered, deliver_at = out.delivered_ms, out.deliver_at_ms
    for m in read_records(bootstrap, topic, watermarks):
        for name, value in reversed(m.headers() or ()):
            if name == DELIVER_AT:
                delivered.append(m.timestamp()[1])
                deliver_at.append(int(value))
                break
    return out


SETTLE_S = 2.0


def settle(ports: list[int], partitions: int, timeout_s: float = 120.0) -> float:
    """Seconds until the sidecars at `ports` own `partitions` between them, each some, unchanged for SETTLE_S."""
    started = time.monotonic()
    stable_since: float | None = None
    last: list[float] = []
    while time.monotonic() - started < timeout_s:
        try:
            owned = [metric_sum(scrape(port), "delay_sidecar_assigned_partitions") for port in ports]
        except OSError:
            owned = []
        if owned and sum(owned) == partitions and min(owned) > 0:
            if owned != last:
                stable_since = time.monotonic()
            elif stable_since is not None and time.monotonic() - stable_since >= SETTLE_S:
                return time.monotonic() - started
        else:
            stable_since = None
        last = owned
        time.sleep(0.1)
    raise RuntimeError(f"the group did not settle on {partitions} partitions in {timeout_s:.0f} s (owned {last})")


class LiveReader:
    """An outbound consumer that keeps reading through faults, as users' consumers do: assigned
    from offset 0 before the faults, librdkafka's default fetch sizes, each record to `take`.

    `finish` reads on until every partition's position reaches its stable end, then stops.
    """

    def __init__(
        self,
        bootstrap: str,
        topics: list[str],
        partitions: int,
        take: Callable[[Message], None],
        isolation: str = "read_committed",
    ) -> None:
        self._take = take
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"live-{uuid.uuid4().hex}",
                                   "enable.auto.commit": False, "isolation.level": isolation})  # fmt: skip
        self._consumer.assign([TopicPartition(t, p, 0) for t in topics for p in range(partitions)])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                for m in self._consumer.consume(1000, 0.2):
                    if m.error() is None:
                        self._take(m)

    def finish(self, timeout_s: float = 60.0) -> bool:
        """True once caught up; False when `timeout_s` passed first. A watermark request that fails
        (NOT_LEADER_FOR_PARTITION just after a leader's node was killed) is asked again."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                with self._lock:
                    positions = self._consumer.position(self._consumer.assignment())
                    try:
                        ends = [
                            self._consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1] for tp in positions
                        ]
                    except KafkaException:  # a leader moving (stale metadata after a broker fault): ask again
                        ends = None
                if ends is not None and all(
                    end <= 0 or tp.offset >= end for tp, end in zip(positions, ends, strict=True)
                ):
                    return True
                time.sleep(0.2)
            return False
        finally:
            self._stop.set()
            self._thread.join(10)
            self._consumer.close()
