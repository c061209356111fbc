"""Retry-with-delay: nacks through the delay sidecar against retriable-kafka-client's retry topic.

Usage: .venv/bin/python -m bench.bench_nack [--messages 100000] [--size 1024] [--delay-ms 1000]

One fresh broker of its own (Apache Kafka; DELAY_SIDECAR_BROKER_KIND=noida-db for the fallback's
figures), two scenarios on it, one after the other (`--order`):

- sidecar: N records of `--size` bytes are produced to an inbound topic; the sidecar (a child process,
  `python -m sidecar run`, one subscription) delivers them to the outbound topic; once all N are there,
  a consumer reads the outbound topic and nacks every first delivery once with `--delay-ms` through
  `sidecar.client.Nacker`, until every record came back with `delay-redelivery-count` 1.
- peer: the same N records are produced to a base topic and consumed with retriable-kafka-client
  (bench/nack_peer/peer.py, in a virtualenv of its own, created when missing), whose target fails
  every first attempt, so each record is re-produced to the retry topic and processed again once its
  retry timestamp (`--delay-ms` later) has passed, until every record was processed twice.

Bytes written because of the retries are read back from the broker afterwards: every control command
and every redelivered outbound record for the sidecar, every retry-topic record for the peer, summed as
key + value + header names and values (and as Kafka v2 record encodings). The broker-side view is the
stored record batches of those topics (after each producer's compression, with batch headers), scanned
from the broker's own files once it has stopped: Apache Kafka's log segments, or noida-db's data file.
Retries per second = N / (last retried record processed - first retry requested).

The values are JSON (retriable-kafka-client only hands JSON objects to its target, and drops anything
else) of exactly `--size` bytes: an id and base64 of random bytes, which no codec the clients use (lz4
for the sidecar, none for the peer and the benchmark's producers) can shrink. Keys are 16 random bytes.
Output: a markdown table on stdout and every figure in bench/results/nack.json.

A limit met on noida-db only: it answers a fetch with the whole backlog of the fetched partitions, so
above ~91,000 records of 1 KB the sidecar's and the peer's consumers (librdkafka's 100 MB
receive.message.max.bytes) stall; on noida-db the script refuses such sizes unless --force (Apache
Kafka honours the fetch size limits). When a run leaves nacks unanswered (the sidecar scenario times
out), the JSON lists the missing ones by control partition.
"""

from __future__ import annotations

import argparse
import base64
import json
import mmap
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, Producer, TopicPartition

from bench.probe import create_topic, scrape
from bench.procs import Child, bench_broker
from bench.report import command_line, environment, header
from sidecar.broker import ApacheKafka, BrokerLauncher, EmbeddedBroker, embedded
from sidecar.broker.ports import free_port
from sidecar.client import Nacker, deliver_at, origin, redelivery_count
from sidecar.client_cancel import LEADER_MOVING

ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = ROOT / "bench" / "nack_peer"
DEFAULT_OUT = ROOT / "bench" / "results" / "nack.json"
DEFAULT_PEER_VENV = Path("/tmp/rkc-venv")
SUBSCRIPTION = "billing"
KEY_BYTES = 16
BYTES_TARGET = 5.0
RATE_TARGET = 2.0

# ---------------------------------------------------------------------------------------------------
# Records and sizes


_T0 = time.monotonic()


def log(text: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {text}", file=sys.stderr, flush=True)


def make_records(count: int, size: int, seed: int) -> list[tuple[bytes, bytes]]:
    """(key, value) pairs: 16 random key bytes, a JSON value of exactly `size` bytes carrying its id."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        prefix = f'{{"id":{i},"pad":"'
        room = size - len(prefix) - 2
        if room < 0:
            raise SystemExit(f"--size {size} is too small for a JSON value with an id; use 64 or more")
        pad = base64.b64encode(rng.randbytes(room * 3 // 4 + 3))[:room].decode("ascii")
        value = f'{prefix}{pad}"}}'.encode("ascii")
        assert len(value) == size
        records.append((rng.randbytes(KEY_BYTES), value))
    return records


def varint_size(value: int) -> int:
    """Bytes of a zigzag varint, as Kafka's v2 record format writes lengths and deltas."""
    zigzag = (value << 1) ^ (value >> 63)
    size = 1
    while zigzag >= 0x80:
        zigzag >>= 7
        size += 1
    return size


@dataclass
class Sizes:
    """What a set of records holds, summed."""

    records: int = 0
    keys: int = 0
    values: int = 0
    header_names: int = 0
    header_values: int = 0
    headers: int = 0
    v2_records: int = 0
    """Kafka v2 record encodings (length, attributes, deltas, varint lengths), without batch headers."""

    def add(self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes | None]]) -> None:
        klen = len(key) if key is not None else -1
        vlen = len(value) if value is not None else -1
        body = 1 + 1 + 1  # attributes, timestamp delta and offset delta (small deltas: one byte each)
        body += varint_size(klen) + max(klen, 0) + varint_size(vlen) + max(vlen, 0) + varint_size(len(headers))
        for name, hvalue in headers:
            nlen, hlen = len(name.encode()), len(hvalue) if hvalue is not None else -1
            body += varint_size(nlen) + nlen + varint_size(hlen) + max(hlen, 0)
            self.header_names += nlen
            self.header_values += max(hlen, 0)
            self.headers += 1
        self.records += 1
        self.keys += max(klen, 0)
        self.values += max(vlen, 0)
        self.v2_records += varint_size(body) + body

    @property
    def payload(self) -> int:
        """key + value + header names and values: the brief's on-wire record size."""
        return self.keys + self.values + self.header_names + self.header_values

    def merged(self, other: Sizes) -> Sizes:
        out = Sizes()
        for name in ("records", "keys", "values", "header_names", "header_values", "headers", "v2_records"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def per_record(self) -> dict[str, float]:
        n = max(self.records, 1)
        return {
            "key": self.keys / n,
            "value": self.values / n,
            "header_names": self.header_names / n,
            "header_values": self.header_values / n,
            "headers_count": self.headers / n,
            "payload": self.payload / n,
            "v2_record": self.v2_records / n,
        }

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "payload": self.payload, "per_record": self.per_record()}


# ---------------------------------------------------------------------------------------------------
# Kafka helpers


def create_topics(bootstrap: str, names: Iterable[str], partitions: int) -> None:
    """Created and led: a watermark asked of a topic Apache Kafka has not given leaders yet fails."""
    for name in names:
        create_topic(bootstrap, name, partitions)


def produce_all(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> float:
    """Produce every record (no compression); the rate in records per second."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "compression.type": "none"})
    errors: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(str(err))

    started = time.monotonic()
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value, key, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(120) != 0 or errors:
        raise RuntimeError(f"producing to {topic} failed: {errors[:3]}")
    return len(records) / max(time.monotonic() - started, 1e-9)


class Watermarks:
    def __init__(self, bootstrap: str) -> None:
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-nack-wm-{uuid.uuid4().hex[:8]}"})

    def ends(self, topic: str, partitions: int, patience_s: float = 30.0) -> list[int]:
        """A leader that is not known yet or moves (Apache Kafka, right after a topic's creation) is
        asked again for `patience_s`, with fresh metadata each time."""
        return [self._end(TopicPartition(topic, p), patience_s) for p in range(partitions)]

    def _end(self, partition: TopicPartition, patience_s: float) -> int:
        deadline = time.monotonic() + patience_s
        while True:
            try:
                return int(self._consumer.get_watermark_offsets(partition, timeout=10, cached=False)[1])
            except KafkaException as e:
                moving = e.args[0].retriable() or e.args[0].code() in LEADER_MOVING
                if not moving or time.monotonic() > deadline:
                    raise
                self._consumer.list_topics(partition.topic, timeout=5)
                time.sleep(0.1)

    def wait_total(self, topic: str, partitions: int, total: int, timeout_s: float, alive: Callable[[], bool]) -> float:
        """Block until the topic holds `total` records; seconds waited."""
        started = time.monotonic()
        while (held := self.total(topic, partitions)) < total:
            if not alive():
                raise RuntimeError("a process under test exited while waiting")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{topic} holds {held} of {total} after {timeout_s}s")
            time.sleep(0.05)
        return time.monotonic() - started

    def total(self, topic: str, partitions: int) -> int:
        """Records in the topic; 0 while it does not exist yet (the sidecar creates outbound topics)."""
        try:
            return sum(self.ends(topic, partitions, patience_s=0.0))
        except KafkaException:
            # librdkafka caches "unknown topic" until its next metadata refresh (5 minutes by
            # default): ask for the topic's metadata again, or a topic created since stays unknown.
            self._consumer.list_topics(topic, timeout=5)
            return 0

    def close(self) -> None:
        self._consumer.close()


def read_back(
    bootstrap: str,
    topic: str,
    partitions: int,
    select: Callable[[Any], bool] = lambda _m: True,
    start: list[int] | None = None,
) -> tuple[Sizes, list[Any]]:
    """Read a topic from `start` (default: the beginning) to its end; sizes of the selected records."""
    watermarks = Watermarks(bootstrap)
    ends = watermarks.ends(topic, partitions)
    watermarks.close()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-nack-read-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            **BIG_RECEIVE,
        }
    )
    offsets = start or [OFFSET_BEGINNING] * partitions
    consumer.assign([TopicPartition(topic, p, offsets[p]) for p in range(partitions)])
    next_offset = [offsets[p] if offsets[p] >= 0 else 0 for p in range(partitions)]
    sizes = Sizes()
    selected: list[Any] = []
    deadline = time.monotonic() + 300
    try:
        while any(next_offset[p] < ends[p] for p in range(partitions)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} back: at {next_offset} of {ends}")
            for message in consumer.consume(5000, 0.5):
                if message.error() is not None:
                    continue
                next_offset[message.partition()] = message.offset() + 1
                if select(message):
                    sizes.add(message.key(), message.value(), list(message.headers() or []))
                    selected.append(message)
    finally:
        consumer.close()
    return sizes, selected


# ---------------------------------------------------------------------------------------------------
# Broker-side view: the record batches the broker stores, scanned from its own files once it stopped


@dataclass
class Stored:
    batches: int = 0
    records: int = 0
    bytes: int = 0
    codecs: dict[str, int] = field(default_factory=dict)


def count_batch(stored: Stored, header: bytes) -> None:
    """One stored v2 record batch, from its first 61 bytes: base offset (8), length (4), leader epoch
    (4), magic (1), CRC (4), attributes (2), last offset delta (4), timestamps (16), producer id (8),
    producer epoch (2), base sequence (4), record count (4). Both brokers store this same layout."""
    codec = CODECS.get(int.from_bytes(header[21:23], "big") & 0x7, "?")
    stored.batches += 1
    stored.records += int.from_bytes(header[57:61], "big")
    stored.bytes += batch_length(header)
    stored.codecs[codec] = stored.codecs.get(codec, 0) + 1


CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
BATCH_HEADER_BYTES = 61

Wanted = dict[str, tuple[int, list[int] | None]]
"""Topic -> (partitions, first offset per partition to count, or None for all)."""


def batch_length(header: bytes) -> int:
    """A whole batch's bytes: the length field counts what follows it (12 bytes in)."""
    return 12 + int.from_bytes(header[8:12], "big")


def scan_stored(broker: BrokerLauncher, wanted: Wanted) -> dict[str, Stored]:
    """The stored batches of each wanted topic, from the files of the broker that ran (stopped)."""
    if isinstance(broker, ApacheKafka):
        return scan_segments([node.directory / "data" for node in broker.nodes], wanted)
    if isinstance(broker, EmbeddedBroker):
        return scan_noida(broker.data_dir / "kafka.json", wanted)
    raise ValueError(f"no files of {broker.description} to scan")


def scan_segments(log_dirs: list[Path], wanted: Wanted) -> dict[str, Stored]:
    """Apache Kafka keeps each partition's batches as they came from the producer, one after the
    other, in `<log dir>/<topic>-<partition>/*.log` segments. Every replica holds the same batches,
    so each partition is read from the first node that has it."""
    out: dict[str, Stored] = {}
    for topic, (partitions, from_offsets) in wanted.items():
        stored = Stored()
        for partition in range(partitions):
            folders = [d / f"{topic}-{partition}" for d in log_dirs if (d / f"{topic}-{partition}").is_dir()]
            if not folders:
                raise ValueError(f"{topic}-{partition} is in none of {[str(d) for d in log_dirs]}")
            for segment in sorted(folders[0].glob("*.log")):
                data = segment.read_bytes()
                pos = 0
                while pos + BATCH_HEADER_BYTES <= len(data):
                    header = data[pos : pos + BATCH_HEADER_BYTES]
                    length = batch_length(header)
                    if length == 12:  # zeros past the last batch: a segment that was preallocated
                        break
                    base_offset = int.from_bytes(header[:8], "big")
                    if from_offsets is None or base_offset >= from_offsets[partition]:
                        count_batch(stored, header)
                    pos += length
        out[topic] = stored
    return out


def scan_noida(data_file: Path, wanted: Wanted) -> dict[str, Stored]:
    """noida-db keeps every partition's batches in `kafka.json` as `[base_offset,[byte,byte,...]]`; the
    batch header gives its exact length, record count and compression codec."""
    out: dict[str, Stored] = {}
    with data_file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for topic, (partitions, from_offsets) in wanted.items():
            stored = Stored()
            at = mm.find(b'["' + topic.encode() + b'",{"name":')
            if at < 0:
                raise ValueError(f"topic {topic} not in {data_file}")
            for _ in range(partitions):
                head = mm.find(b'"id":', at)
                partition = int(mm[head + 5 : mm.find(b",", head)])
                start = mm.find(b'"record_batches":[', at) + len(b'"record_batches":[')
                end = mm.find(b'],"high_watermark"', start)
                if start < len(b'"record_batches":[') or end < 0:
                    raise ValueError(f"unexpected layout of {data_file} at topic {topic}")
                pos = start
                while pos < end:
                    comma = mm.find(b",", pos)
                    base_offset = int(mm[pos + 1 : comma])
                    inner_end = mm.find(b"]", comma)
                    batch = mm[comma + 2 : inner_end]
                    header = bytes(int(x) for x in batch[:400].split(b",")[:BATCH_HEADER_BYTES])
                    if batch.count(b",") + 1 != batch_length(header):
                        raise ValueError(f"batch at {topic}/{partition}@{base_offset}: length field disagrees")
                    if from_offsets is None or base_offset >= from_offsets[partition]:
                        count_batch(stored, header)
                    pos = inner_end + 2
                    if mm[pos : pos + 1] == b",":
                        pos += 1
                at = end
            out[topic] = stored
    return out


# ---------------------------------------------------------------------------------------------------
# Scenario (a): nacks through the sidecar


@dataclass
class Outcome:
    name: str
    retries_expected: int
    retried: int = 0
    duplicates: int = 0
    first_request_s: float | None = None
    last_retried_s: float | None = None
    written: dict[str, Sizes] = field(default_factory=dict)
    """Topic role -> sizes of the records the retries caused there."""
    stored: dict[str, Stored] = field(default_factory=dict)
    stored_from: dict[str, tuple[str, int, list[int] | None]] = field(default_factory=dict)
    """Topic role -> (topic, partitions, first offset per partition written by retries)."""
    watermark_deltas: dict[str, int] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float | None:
        if self.first_request_s is None or self.last_retried_s is None:
            return None
        return self.last_retried_s - self.first_request_s

    @property
    def rate(self) -> float | None:
        wall = self.wall_s
        return self.retried / wall if wall else None

    @property
    def total(self) -> Sizes:
        out = Sizes()
        for sizes in self.written.values():
            out = out.merged(sizes)
        return out

    def per_retry(self, amount: int) -> float:
        return amount / max(self.retried, 1)

    def stored_bytes(self) -> int | None:
        if not self.stored:
            return None
        return sum(s.bytes for s in self.stored.values())

    def as_json(self) -> dict[str, Any]:
        total = self.total
        stored = self.stored_bytes()
        return {
            "name": self.name,
            "retries_expected": self.retries_expected,
            "retried": self.retried,
            "duplicates": self.duplicates,
            "wall_s": self.wall_s,
            "retries_per_s": self.rate,
            "written": {role: sizes.as_json() for role, sizes in self.written.items()},
            "written_total": total.as_json(),
            "bytes_per_retry": self.per_retry(total.payload),
            "v2_bytes_per_retry": self.per_retry(total.v2_records),
            "records_per_retry": total.records / max(self.retried, 1),
            "watermark_deltas": self.watermark_deltas,
            "stored": {role: asdict(s) for role, s in self.stored.items()},
            "stored_bytes_per_retry": self.per_retry(stored) if stored is not None else None,
            "figures": self.figures,
            "notes": self.notes,
        }


def process_usage(pid: int) -> dict[str, float]:
    try:
        import psutil  # type: ignore[import-untyped,unused-ignore]  # noqa: PLC0415 (optional dev dependency)
    except ImportError:
        return {}
    try:
        proc = psutil.Process(pid)
        cpu = proc.cpu_times()
        return {"cpu_user_s": cpu.user, "cpu_system_s": cpu.system, "rss_mib": proc.memory_info().rss / 2**20}
    except psutil.Error:
        return {}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"min": round(ordered[0], 1), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 1)}


def late_per_second(again: list[Message]) -> list[dict[str, float]]:
    """Written-late percentiles per second of deliver-at, from the first: when in the burst the
    lateness comes (a stall shows as one bad second, a sidecar falling behind as a rising line)."""
    if not again:
        return []
    first = min(deliver_at(m) for m in again)
    seconds: dict[int, list[float]] = {}
    for m in again:
        seconds.setdefault((deliver_at(m) - first) // 1000, []).append(max(m.timestamp()[1] - deliver_at(m), 0))
    return [{"second": second, "count": len(late)} | percentiles(late) for second, late in sorted(seconds.items())]


def run_sidecar(args: argparse.Namespace, bootstrap: str, records: list[tuple[bytes, bytes]], work: Path) -> Outcome:
    n, partitions = len(records), args.partitions
    tag = uuid.uuid4().hex[:6]
    inbound, control = f"nack.in-{tag}", f"nack.ctl-{tag}"
    outbound = f"{inbound}.{SUBSCRIPTION}"
    create_topics(bootstrap, [inbound, control], partitions)
    policies = work / "nack-policies.yaml"
    policies.write_text(f"topics:\n  {inbound}:\n    subscriptions:\n      {SUBSCRIPTION}: {{}}\n")
    outcome = Outcome("sidecar", n)
    outcome.figures["produce_rate"] = produce_all(bootstrap, inbound, records)
    metrics_port = free_port()
    child = Child(
        [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--bootstrap-servers",
            bootstrap,
            "--policies",
            str(policies),
            "--state-dir",
            str(work / "sidecar-state"),
            "--metrics-port",
            str(metrics_port),
            "--group-id",
            f"sidecar-{tag}",
            "--control-topic",
            control,
            "--log-level",
            args.sidecar_log_level,
            *shlex.split(args.sidecar_args),
        ],
        work / "sidecar.log",
    )
    watermarks = Watermarks(bootstrap)
    try:
        started = time.monotonic()
        first_pass_s = watermarks.wait_total(outbound, partitions, n, args.timeout_s, child.alive)
        outcome.figures["first_delivery_s"] = first_pass_s
        outbound_before = watermarks.ends(outbound, partitions)
        control_before = watermarks.ends(control, partitions)
        log(f"all {n:,} first deliveries are on {outbound}; nacking")
        before = process_usage(child.process.pid)
        redelivered, nack_s, received = consume_and_nack(args, bootstrap, outbound, control, n, outcome)
        after = process_usage(child.process.pid)
        if before and after:  # the nacks' own cost, without the first deliveries'
            outcome.figures["sidecar_cpu_nacks_s"] = sum(after[k] - before[k] for k in ("cpu_user_s", "cpu_system_s"))
        outcome.retried = len(redelivered)
        outcome.figures["retry_delays_ms"] = percentiles(
            [(received[key] - nack_s[key]) * 1000 for key in redelivered if key in nack_s]
        )
        time.sleep(1.0)  # anything written late still counts (a duplicate would show here)
        outbound_after = watermarks.ends(outbound, partitions)
        control_after = watermarks.ends(control, partitions)
        outcome.watermark_deltas = {
            "outbound": sum(outbound_after) - sum(outbound_before),
            "control": sum(control_after) - sum(control_before),
        }
        samples = scrape(metrics_port, timeout_s=5)
        complete = len(redelivered) == n
        outcome.figures["sidecar_metrics"] = {
            name: value
            for name, value in samples.items()
            if name.startswith("delay_sidecar_")
            and not name.startswith(("delay_sidecar_delivery_lateness_seconds_bucket",))
            and (not complete or name.startswith(("delay_sidecar_nack_total", "delay_sidecar_redeliveries_total")))
        }
        outcome.figures["sidecar_process"] = process_usage(child.process.pid)
        outcome.figures["scenario_s"] = time.monotonic() - started
    except BaseException:
        print(child.tail(3000), file=sys.stderr)
        raise
    finally:
        code = child.stop()
        watermarks.close()
    log(f"sidecar stopped (exit {code}); reading back what the retries wrote")
    if code != 0:
        outcome.notes.append(f"the sidecar exited with code {code}; its log ends: {child.tail(500)}")
    state_bytes = sum(p.stat().st_size for p in (work / "sidecar-state").rglob("*") if p.is_file())
    outcome.figures["sidecar_state_dir_bytes"] = state_bytes

    # What the retries wrote: every control command, every outbound record with a redelivery count >= 1.
    control_sizes, _ = read_back(bootstrap, control, partitions)
    redelivery_sizes, again = read_back(
        bootstrap, outbound, partitions, select=lambda m: redelivery_count(m) >= 1, start=outbound_before
    )
    outcome.written = {"control": control_sizes, "outbound_redelivered": redelivery_sizes}
    counts: dict[int, int] = {}
    for message in again:
        count = redelivery_count(message)
        counts[count] = counts.get(count, 0) + 1
    outcome.figures["redelivery_counts_on_outbound"] = counts
    # The sidecar's own lateness, without the application's: when it wrote each redelivery (the
    # record's timestamp) after the nack's deliver-at. The observed delay adds how long the
    # application took to read it, behind the first deliveries still unread on its partitions.
    outcome.figures["written_late_ms"] = percentiles([max(m.timestamp()[1] - deliver_at(m), 0) for m in again])
    outcome.figures["written_late_per_second"] = late_per_second(again)
    for second in outcome.figures["written_late_per_second"]:
        text = "written late, second {second} of the deliver-ats: {count} redeliveries, p50 {p50} / p99 {p99} ms"
        log(text.format(**second))
    if outcome.retried < n:
        outcome.figures["missing"] = missing_report(bootstrap, control, partitions, again)
    dead, _ = read_back(bootstrap, f"{control}.dlt", partitions)
    outcome.figures["control_dead_letters"] = dead.records
    if dead.records:
        outcome.notes.append(f"{dead.records} nack commands went to {control}.dlt")
    outcome.stored_from = {
        "control": (control, partitions, None),
        "outbound_redelivered": (outbound, partitions, outbound_before),
    }
    return outcome


def missing_report(bootstrap: str, control: str, partitions: int, again: list[Any]) -> dict[str, Any]:
    """Which nacks never came back: by inbound partition, and by the control partition of their command."""
    back = {(origin(m).partition, origin(m).offset) for m in again}
    _, commands = read_back(bootstrap, control, partitions)
    by_inbound: dict[int, int] = {}
    by_control: dict[int, list[int]] = {}
    for record in commands:
        command = json.loads(record.value())
        if (command["partition"], command["offset"]) in back:
            continue
        by_inbound[command["partition"]] = by_inbound.get(command["partition"], 0) + 1
        by_control.setdefault(record.partition(), []).append(record.offset())
    return {
        "by_inbound_partition": by_inbound,
        "by_control_partition": {
            p: {"count": len(offs), "first_offset": min(offs), "last_offset": max(offs)}
            for p, offs in sorted(by_control.items())
        },
    }


def consume_and_nack(
    args: argparse.Namespace, bootstrap: str, outbound: str, control: str, n: int, outcome: Outcome
) -> tuple[set[tuple[int, int]], dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """The application: nack every first delivery once; stop when every message came back."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"app-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **BIG_RECEIVE,
        }
    )
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    nacker = Nacker(producer, control_topic=control, subscription=SUBSCRIPTION)
    consumer.subscribe([outbound])
    nack_s: dict[tuple[int, int], float] = {}
    received: dict[tuple[int, int], float] = {}
    redelivered: set[tuple[int, int]] = set()
    per_record = args.nack_flush == "record"
    deadline = time.monotonic() + args.timeout_s
    try:
        while len(redelivered) < n:
            if time.monotonic() > deadline:
                outcome.notes.append(f"timed out: {len(redelivered)} of {n} came back")
                break
            batch = consumer.consume(1000, 0.1)
            got = False
            for message in batch:
                if message.error() is not None:
                    continue
                got = True
                message_id = origin(message)
                key = (message_id.partition, message_id.offset)
                if redelivery_count(message) == 0:
                    now = time.time()
                    if outcome.first_request_s is None:
                        outcome.first_request_s = now
                    nacker.nack(message, args.delay_ms)
                    nack_s[key] = now
                    if per_record:
                        nacker.flush()
                        consumer.commit(message=message, asynchronous=False)
                else:
                    now = time.time()
                    if key in redelivered:
                        outcome.duplicates += 1
                        continue
                    redelivered.add(key)
                    received[key] = now
                    outcome.last_retried_s = now
            if got and not per_record:
                # Commit only once the nacks are written (README): one flush and one commit per poll.
                nacker.flush()
                try:
                    consumer.commit(asynchronous=False)
                except KafkaException as e:
                    outcome.notes.append(f"commit failed: {e}")
        outcome.figures["nacks_sent"] = len(nack_s)
        if nack_s:
            outcome.figures["nack_phase_s"] = max(nack_s.values()) - min(nack_s.values())
    finally:
        nacker.flush()
        consumer.close()
    return redelivered, nack_s, received


# ---------------------------------------------------------------------------------------------------
# Scenario (b): retriable-kafka-client's retry topic


PEER_MIN_PYTHON = (3, 13)
"""retriable-kafka-client 0.7.0 says Requires-Python >=3.9, but its modules need 3.13 to import: a
one-argument `Generator[...]` in an annotation evaluated at class definition, and `re.PatternError`."""


def python_version(python: str | Path) -> tuple[int, int] | None:
    try:
        done = subprocess.run(
            [str(python), "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, check=False
        )
    except OSError:
        return None
    if done.returncode != 0:
        return None
    major, minor = done.stdout.split()
    return int(major), int(minor)


def find_peer_python(explicit: str | None) -> str:
    """An interpreter new enough for the peer: --peer-python, python3.13+ on PATH, or a pyenv 3.13+."""
    candidates: list[str] = [explicit] if explicit else []
    candidates += [found for name in ("python3.14", "python3.13") if (found := shutil.which(name))]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv.is_dir():
        candidates += [str(p / "bin" / "python3") for p in sorted(pyenv.iterdir(), reverse=True)]
    for candidate in candidates:
        version = python_version(candidate)
        if version is not None and version >= PEER_MIN_PYTHON:
            return candidate
    raise SystemExit(
        "retriable-kafka-client 0.7.0 imports only on Python 3.13 or later and none was found; "
        "pass one with --peer-python"
    )


def ensure_peer_venv(venv: Path, explicit_python: str | None) -> Path:
    """The peer's own virtualenv (it pins confluent-kafka==2.15.1); created on first use."""
    python = venv / "bin" / "python"
    requirements = PEER_DIR / "requirements.txt"
    version = python_version(python) if python.exists() else None
    if version is None or version < PEER_MIN_PYTHON:
        base = find_peer_python(explicit_python)
        print(f"creating the peer's virtualenv at {venv} with {base}", file=sys.stderr)
        subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True)
    probe = [str(python), "-c", "import retriable_kafka_client"]
    if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True)
        subprocess.run(probe, check=True)
    return python


def run_peer(
    args: argparse.Namespace, bootstrap: str, records: list[tuple[bytes, bytes]], work: Path, python: Path
) -> Outcome:
    n, partitions = len(records), args.partitions
    tag = uuid.uuid4().hex[:6]
    base, retry = f"nack.peer-in-{tag}", f"nack.peer-retry-{tag}"
    create_topics(bootstrap, [base, retry], partitions)
    outcome = Outcome("retriable-kafka-client", n)
    outcome.figures["produce_rate"] = produce_all(bootstrap, base, records)
    watermarks = Watermarks(bootstrap)
    retry_before = watermarks.ends(retry, partitions)
    argv = [
        str(python),
        str(PEER_DIR / "peer.py"),
        "--bootstrap",
        bootstrap,
        "--topic",
        base,
        "--retry-topic",
        retry,
        "--group",
        f"peer-{tag}",
        "--messages",
        str(n),
        "--delay-ms",
        str(args.delay_ms),
        "--workers",
        str(args.peer_workers),
        "--timeout-s",
        str(args.timeout_s),
    ]
    peer_log = work / "peer.log"
    started = time.monotonic()
    with peer_log.open("ab") as err:
        done = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, timeout=args.timeout_s + 120, check=False
        )
    outcome.figures["scenario_s"] = time.monotonic() - started
    lines = done.stdout.decode().strip().splitlines()
    if not lines:
        raise RuntimeError(f"the peer printed nothing (exit {done.returncode}); see {peer_log}")
    report: dict[str, Any] = json.loads(lines[-1])
    outcome.figures["peer"] = report
    if not report["finished"]:
        outcome.notes.append(f"the peer timed out: {report['retried']} of {n} retried")
    outcome.retried = int(report["retried"])
    outcome.duplicates = int(report["extra_attempts"])
    outcome.first_request_s = report["first_failure_s"]
    outcome.last_retried_s = report["last_retry_s"]
    outcome.figures["retry_delays_ms"] = report.get("retry_delays_ms", {})
    retry_after = watermarks.ends(retry, partitions)
    watermarks.close()
    outcome.watermark_deltas = {"retry": sum(retry_after) - sum(retry_before)}
    log("peer done; reading back the retry topic")
    retry_sizes, _ = read_back(bootstrap, retry, partitions)
    outcome.written = {"retry_topic": retry_sizes}
    outcome.stored_from = {"retry_topic": (retry, partitions, None)}
    return outcome


# ---------------------------------------------------------------------------------------------------
# Report


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return numerator / denominator


def markdown(sidecar: Outcome, peer: Outcome, args: argparse.Namespace) -> str:
    s_total, p_total = sidecar.total, peer.total
    s_bytes, p_bytes = sidecar.per_retry(s_total.payload), peer.per_retry(p_total.payload)
    s_v2, p_v2 = sidecar.per_retry(s_total.v2_records), peer.per_retry(p_total.v2_records)
    s_stored, p_stored = sidecar.stored_bytes(), peer.stored_bytes()
    s_st = sidecar.per_retry(s_stored) if s_stored is not None else None
    p_st = peer.per_retry(p_stored) if p_stored is not None else None
    bytes_ratio = ratio(p_bytes, s_bytes)
    rate_ratio = ratio(sidecar.rate, peer.rate)
    stored_ratio = ratio(p_st, s_st)

    incomplete = sidecar.retried < sidecar.retries_expected or peer.retried < peer.retries_expected

    def met(value: float | None, target: float) -> str:
        if value is None or incomplete:
            return "- (a scenario did not complete)" if incomplete else "-"
        return "yes" if value >= target else f"**no** ({target / value:.1f}x short)"

    rows = [
        "| per retry | sidecar nack | retriable-kafka-client | peer / sidecar | target | met |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| retries completed | {sidecar.retried:,} of {sidecar.retries_expected:,} | "
        f"{peer.retried:,} of {peer.retries_expected:,} | | | |",
        f"| records written | {s_total.records / max(sidecar.retried, 1):.2f} | "
        f"{p_total.records / max(peer.retried, 1):.2f} | | | |",
        f"| bytes written (key+value+headers) | {fmt(s_bytes)} | {fmt(p_bytes)} | {fmt(bytes_ratio, 2)}x | "
        f">= {BYTES_TARGET:.0f}x fewer | {met(bytes_ratio, BYTES_TARGET)} |",
        f"| bytes written (v2 record encoding) | {fmt(s_v2)} | {fmt(p_v2)} | {fmt(ratio(p_v2, s_v2), 2)}x | | |",
        f"| bytes stored by the broker (batches, after compression) | {fmt(s_st)} | {fmt(p_st)} | "
        f"{fmt(stored_ratio, 2)}x | | |",
        f"| retries per second | {fmt(sidecar.rate)} | {fmt(peer.rate)} | "
        f"{fmt(rate_ratio, 2)}x (sidecar / peer) | >= {RATE_TARGET:.0f}x | {met(rate_ratio, RATE_TARGET)} |",
        f"| wall time, first retry asked to last retried (s) | {fmt(sidecar.wall_s, 2)} | {fmt(peer.wall_s, 2)} "
        "| | | |",
        f"| observed delay min / p50 / p99 / max (ms), asked {args.delay_ms} | "
        f"{delays(sidecar)} | {delays(peer)} | | | |",
        f"| written late: redelivery timestamp minus its deliver-at, min / p50 / p99 / max (ms) | "
        f"{delays(sidecar, 'written_late_ms')} | - | | <= 250 (p99) | |",
    ]
    breakdown = ["", "| written because of retries | records | key | value | header names | header values | "
                 "headers / record | bytes / record | v2 bytes / record | stored bytes / record |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for outcome in (sidecar, peer):
        for role, sizes in outcome.written.items():
            per = sizes.per_record()
            stored = outcome.stored.get(role)
            stored_per = stored.bytes / max(stored.records, 1) if stored is not None else None
            codecs = f" ({','.join(stored.codecs)})" if stored is not None else ""
            breakdown.append(
                f"| {outcome.name}: {role} | {sizes.records:,} | {per['key']:.1f} | {per['value']:.1f} | "
                f"{per['header_names']:.1f} | {per['header_values']:.1f} | {per['headers_count']:.1f} | "
                f"{per['payload']:.1f} | {per['v2_record']:.1f} | {fmt(stored_per, 1)}{codecs} |"
            )
    return "\n".join(rows + breakdown)


def delays(outcome: Outcome, figure: str = "retry_delays_ms") -> str:
    d = outcome.figures.get(figure) or {}
    if not d:
        return "-"
    return f"{d['min']:,.0f} / {d['p50']:,.0f} / {d['p99']:,.0f} / {d['max']:,.0f}"


# ---------------------------------------------------------------------------------------------------
# Main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000, help="records, each retried once")
    parser.add_argument("--size", type=int, default=1024, help="value bytes of each record")
    parser.add_argument("--delay-ms", type=int, default=1000, help="retry delay")
    parser.add_argument("--partitions", type=int, default=3, help="partitions of every topic")
    parser.add_argument("--order", default="peer,sidecar", help="which scenario runs first on the shared broker")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV, help="created when missing")
    parser.add_argument("--peer-python", help="Python 3.13+ to create the peer's virtualenv with")
    parser.add_argument("--peer-workers", type=int, default=16, help="the peer's thread pool = its max_concurrency")
    parser.add_argument(
        "--nack-flush",
        choices=("batch", "record"),
        default="batch",
        help="flush the nacks and commit once per poll of up to 1000 records, or after every record",
    )
    parser.add_argument("--sidecar-args", default="", help="more flags for `sidecar run`, e.g. '--tracker memory'")
    parser.add_argument("--sidecar-log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per scenario")
    parser.add_argument("--no-broker-scan", action="store_true", help="skip the scan of the broker's files")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--force", action="store_true", help="run even above noida-db's fetch limit")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (broker data, logs)")
    args = parser.parse_args(argv)
    if sorted(args.order.split(",")) != ["peer", "sidecar"] and args.order not in ("peer", "sidecar"):
        parser.error("--order is 'peer,sidecar' or 'sidecar,peer' (or one of them alone, for diagnosis)")
    return args


# noida-db answers a fetch with everything from the fetch offsets to the end of the fetched partitions,
# whatever fetch.max.bytes and max.partition.fetch.bytes say, and librdkafka drops any response over
# receive.message.max.bytes (100,000,000 by default; neither the sidecar nor the peer raise it). A
# backlog above that leaves the sidecar's inbound consumer and log reader, and the peer's consumer,
# failing the same fetch forever ("Invalid response size 105000023").
FETCH_LIMIT_BYTES = 100_000_000
RECORD_OVERHEAD_BYTES = 30  # v2 record framing around key and value, without headers
BIG_RECEIVE = {"receive.message.max.bytes": 2_000_000_000, "fetch.max.bytes": 1_000_000_000}
"""For the benchmark's own consumers only, which read whole topics back."""


def refuse_fetch_limit(args: argparse.Namespace, broker: BrokerLauncher) -> None:
    """On noida-db only (see FETCH_LIMIT_BYTES): Apache Kafka honours the fetch size limits."""
    if not isinstance(broker, EmbeddedBroker) or args.force:
        return
    backlog = args.messages * (args.size + KEY_BYTES + RECORD_OVERHEAD_BYTES)
    if backlog >= FETCH_LIMIT_BYTES * 0.98:
        largest = int(FETCH_LIMIT_BYTES * 0.98 / (args.size + KEY_BYTES + RECORD_OVERHEAD_BYTES))
        raise SystemExit(
            f"{args.messages:,} records of {args.size} bytes make a {backlog / 1e6:.0f} MB backlog, which "
            f"noida-db returns in one fetch response, over librdkafka's {FETCH_LIMIT_BYTES / 1e6:.0f} MB "
            f"receive.message.max.bytes: the sidecar and the peer would both stall. Use --messages {largest:,} "
            "or less (or --force, or Apache Kafka: unset DELAY_SIDECAR_BROKER_KIND)."
        )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-nack-"))
    broker = bench_broker(work / "broker")
    try:
        refuse_fetch_limit(args, broker)
        python = ensure_peer_venv(args.peer_venv, args.peer_python) if "peer" in args.order.split(",") else None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    records = make_records(args.messages, args.size, args.seed)
    command = command_line("bench.bench_nack", argv)
    bootstrap = broker.start()
    env = environment(broker, command)
    log(f"broker {broker.description} at {bootstrap}, work dir {work}")
    outcomes: dict[str, Outcome] = {}
    try:
        for name in args.order.split(","):
            log(f"running {name} with {args.messages:,} records")
            if name == "sidecar":
                outcomes[name] = run_sidecar(args, bootstrap, records, work)
            else:
                assert python is not None
                outcomes[name] = run_peer(args, bootstrap, records, work, python)
            o = outcomes[name]
            log(f"{name}: {o.retried:,} retried in {fmt(o.wall_s, 2)} s = {fmt(o.rate)}/s")
    finally:
        # noida-db writes its whole log as JSON when it stops; give it the time that takes.
        embedded.STOP_GRACE_S = 600.0
        log("stopping the broker")
        broker.stop()
        log("broker stopped")
    scan_note = None
    if args.no_broker_scan:
        scan_note = "not scanned (--no-broker-scan)"
    else:
        wanted = {t: (p, offs) for o in outcomes.values() for (t, p, offs) in o.stored_from.values()}
        try:
            stored = scan_stored(broker, wanted)
            log("scanned the broker's files")
            for o in outcomes.values():
                o.stored = {role: stored[t] for role, (t, _p, _offs) in o.stored_from.items()}
        except (ValueError, OSError) as e:
            scan_note = f"not scanned: {e}"
            print(f"broker-side scan failed: {e}", file=sys.stderr)
    sidecar = outcomes.get("sidecar") or Outcome("sidecar (not run)", 0)
    peer = outcomes.get("peer") or Outcome("retriable-kafka-client (not run)", 0)
    table = markdown(sidecar, peer, args)
    print("\n".join(header(env)) + "\n")
    print(table)
    if scan_note is not None:
        print(f"- bytes stored by the broker: {scan_note}")
    for o in (sidecar, peer):
        for note in o.notes:
            print(f"- {o.name}: {note}")
    result = {
        "command": command,
        "date_utc": env["date"],
        "broker": env["broker"],
        "environment": env,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "python": platform.python_version(),
        },
        "targets": {"bytes_fewer_x": BYTES_TARGET, "retries_per_s_x": RATE_TARGET},
        "sidecar": sidecar.as_json(),
        "peer": peer.as_json(),
        "ratios": {
            "bytes_per_retry_peer_over_sidecar": ratio(
                peer.per_retry(peer.total.payload), sidecar.per_retry(sidecar.total.payload)
            ),
            "v2_bytes_per_retry_peer_over_sidecar": ratio(
                peer.per_retry(peer.total.v2_records), sidecar.per_retry(sidecar.total.v2_records)
            ),
            "stored_bytes_per_retry_peer_over_sidecar": ratio(
                peer.per_retry(peer.stored_bytes() or 0), sidecar.per_retry(sidecar.stored_bytes() or 0)
            ),
            "retries_per_s_sidecar_over_peer": ratio(sidecar.rate, peer.rate),
        },
        "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {args.out}", file=sys.stderr)
    if args.keep:
        print(f"kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    complete = all(o.retried == o.retries_expected for o in (sidecar, peer))
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
