"""A Spark batch data source over confluent-kafka with the schema and options of Spark's built-in `kafka`.

Spark's own Kafka source lives in the spark-sql-kafka-0-10 connector, which comes from a Maven
repository (spark.connector fetches it once; the audit reads with it by default); where it can be
neither fetched nor found, this Python data source (pyspark.sql.datasource) reads the same records
into the same schema, so code written against one runs on the other (tests compare them):

    key binary, value binary, topic string, partition int, offset long, timestamp timestamp,
    timestampType int, headers array<struct<key:string,value:binary>>   (headers: includeHeaders=true)

Options honoured, with the built-in source's names and meanings:

* `kafka.bootstrap.servers` (required) and any other `kafka.*` option, passed to librdkafka without
  the prefix (librdkafka and the Java client share most names: security.protocol, sasl.mechanism,
  sasl.username, sasl.password, ssl.ca.location, isolation.level ...);
* `subscribe` (comma list of topics) or `assign` (JSON `{"topic":[0,1]}`);
* `startingOffsets`: `earliest` (default) or JSON `{"topic":{"0":23,"1":-2}}` (-2 earliest);
  `endingOffsets`: `latest` (default) or JSON `{"topic":{"0":50,"1":-1}}` (-1 latest);
* `startingTimestamp` / `endingTimestamp` (epoch ms, all partitions) and `startingOffsetsByTimestamp` /
  `endingOffsetsByTimestamp` (JSON `{"topic":{"0":1700000000000}}`), which win over the offset options;
* `includeHeaders` (default false), `failOnDataLoss` (default true), `minPartitions` and
  `maxRecordsPerPartition` (split large ranges, as Spark 4's KafkaOffsetRangeCalculator does),
  `kafkaConsumer.pollTimeoutMs` (default 120000).

One Spark partition (InputPartition) per Kafka topic-partition offset range, or per piece of a
large range, as the built-in source plans it, so the read runs in parallel on a cluster.

Records reach Spark as Arrow record batches (pyarrow.RecordBatch from read(), which every PySpark
with Python data sources, 4.0 and later, accepts): Spark takes them column by column, with no
Python object per row on its side. What stays per record in Python is confluent-kafka's own
Message accessors; they are called in list comprehensions, and everything constant per range or
computable per column (topic, partition, timestamp units and types) is built by pyarrow.

This module imports nothing of the sidecar: executors need only pyspark, pyarrow and confluent-kafka.
"""

from __future__ import annotations

import bisect
import itertools
import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME, Consumer, KafkaError, TopicPartition
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

SOURCE_NAME = "delay_sidecar_kafka"
"""The format name this source is registered under (`spark.read.format(SOURCE_NAME)`)."""

EARLIEST = -2
LATEST = -1
BATCH_ROWS = 20_000

HEADERS_TYPE = ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())]))


def kafka_schema(include_headers: bool) -> StructType:
    """The schema of Spark's built-in Kafka source (KafkaRecordToRowConverter), field by field."""
    fields = [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
    ]
    if include_headers:
        fields.append(StructField("headers", HEADERS_TYPE))
    return StructType(fields)


class KafkaSourceError(ValueError):
    """An option is wrong or the cluster's data does not match it; the message says which."""


def _flag(options: Mapping[str, str], name: str, default: bool) -> bool:
    value = _option(options, name)
    if value is None:
        return default
    if value.strip().lower() not in ("true", "false"):
        raise KafkaSourceError(f"option {name} must be true or false, got {value!r}")
    return value.strip().lower() == "true"


def _option(options: Mapping[str, str], name: str) -> str | None:
    """Options are case-insensitive in Spark; a plain dict from tests may not be."""
    if name in options:
        return options[name]
    lowered = name.lower()
    for key, value in options.items():
        if key.lower() == lowered:
            return value
    return None


def client_config(options: Mapping[str, str]) -> dict[str, Any]:
    """librdkafka settings from the `kafka.*` options (prefix removed)."""
    config: dict[str, Any] = {}
    for key, value in options.items():
        if key.lower().startswith("kafka."):
            config[key[len("kafka.") :]] = value
    if not any(k.lower() == "bootstrap.servers" for k in config):
        raise KafkaSourceError("option kafka.bootstrap.servers is required (HOST:PORT,...)")
    return config


def _per_partition(text: str, name: str) -> dict[str, dict[int, int]]:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise KafkaSourceError(f"option {name} is not 'earliest', 'latest' or JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise KafkaSourceError(f'option {name} must be a JSON object like {{"topic":{{"0":23}}}}')
    out: dict[str, dict[int, int]] = {}
    for topic, parts in parsed.items():
        if not isinstance(parts, dict):
            raise KafkaSourceError(f"option {name}: topic {topic!r} needs an object of partition -> offset")
        out[topic] = {int(p): int(o) for p, o in parts.items()}
    return out


class KafkaRange(InputPartition):
    """Offsets [start, end) of one topic-partition: one Spark task."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KafkaRange) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


@dataclass(frozen=True)
class OffsetBound:
    """What one side of a range asks for: an offset (>= 0, EARLIEST, LATEST) or a timestamp (ms)."""

    offset: int | None = None
    timestamp: int | None = None


def _bounds(options: Mapping[str, str], side: str, default: int) -> dict[str, dict[int, OffsetBound]] | OffsetBound:
    """The starting or ending bound: one for every partition, or per topic-partition."""
    by_ts = _option(options, f"{side}OffsetsByTimestamp")
    if by_ts:
        return {
            t: {p: OffsetBound(timestamp=ts) for p, ts in parts.items()}
            for t, parts in _per_partition(by_ts, f"{side}OffsetsByTimestamp").items()
        }
    ts = _option(options, f"{side}Timestamp")
    if ts:
        try:
            return OffsetBound(timestamp=int(ts))
        except ValueError:
            raise KafkaSourceError(f"option {side}Timestamp must be epoch milliseconds, got {ts!r}") from None
    text = (_option(options, f"{side}Offsets") or "").strip()
    if not text:
        return OffsetBound(offset=default)
    if text.lower() == "earliest":
        if side == "ending":
            raise KafkaSourceError("option endingOffsets cannot be 'earliest' (as in Spark's Kafka source)")
        return OffsetBound(offset=EARLIEST)
    if text.lower() == "latest":
        if side == "starting":
            # Spark allows it for streams; for a batch it would always read nothing.
            raise KafkaSourceError("option startingOffsets cannot be 'latest' for a batch query")
        return OffsetBound(offset=LATEST)
    return {
        t: {p: OffsetBound(offset=o) for p, o in parts.items()}
        for t, parts in _per_partition(text, f"{side}Offsets").items()
    }


def _topics(options: Mapping[str, str]) -> dict[str, list[int] | None]:
    subscribe = _option(options, "subscribe")
    assign = _option(options, "assign")
    if bool(subscribe) == bool(assign):
        raise KafkaSourceError("give exactly one of the options subscribe (comma list of topics) or assign (JSON)")
    if subscribe:
        names = [t.strip() for t in subscribe.split(",") if t.strip()]
        if not names:
            raise KafkaSourceError("option subscribe names no topic")
        return dict.fromkeys(names)
    try:
        parsed = json.loads(assign or "")
        return {str(t): [int(p) for p in parts] for t, parts in parsed.items()}
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise KafkaSourceError(f'option assign must be JSON like {{"topic":[0,1]}}: {e}') from None


def plan_ranges(options: Mapping[str, str], keep_empty: bool = False) -> list[KafkaRange]:
    """Resolve the options against the cluster into concrete offset ranges (driver side).

    `keep_empty` keeps the partitions with nothing to read (for a complete per-partition snapshot).
    """
    config = client_config(options)
    topics = _topics(options)
    starting = _bounds(options, "starting", EARLIEST)
    ending = _bounds(options, "ending", LATEST)
    fail_on_data_loss = _flag(options, "failOnDataLoss", True)
    min_partitions = _positive(options, "minPartitions")
    max_records = _positive(options, "maxRecordsPerPartition")
    consumer = Consumer({**config, "group.id": f"spark-kafka-plan-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(timeout=30)
        tps: list[tuple[str, int]] = []
        for topic, wanted in topics.items():
            meta = metadata.topics.get(topic)
            if meta is None or meta.error is not None:
                raise KafkaSourceError(f"topic {topic!r} does not exist on {config.get('bootstrap.servers')}")
            parts = sorted(meta.partitions) if wanted is None else wanted
            tps.extend((topic, p) for p in parts)

        def bound_for(
            bounds: dict[str, dict[int, OffsetBound]] | OffsetBound, tp: tuple[str, int], default: int
        ) -> OffsetBound:
            if isinstance(bounds, OffsetBound):
                return bounds
            return bounds.get(tp[0], {}).get(tp[1], OffsetBound(offset=default))

        watermarks = {tp: consumer.get_watermark_offsets(TopicPartition(*tp), timeout=30) for tp in tps}

        def resolve(bound: OffsetBound, tp: tuple[str, int], side: str) -> int:
            low, high = watermarks[tp]
            if bound.timestamp is not None:
                [found] = consumer.offsets_for_times([TopicPartition(tp[0], tp[1], bound.timestamp)], timeout=30)
                # No record at or after the timestamp: the range starts/ends at the end of the partition.
                return int(found.offset) if found.offset >= 0 else int(high)
            offset = int(bound.offset if bound.offset is not None else LATEST)
            if offset == EARLIEST:
                return int(low)
            if offset == LATEST:
                return int(high)
            if offset < low:
                if fail_on_data_loss:
                    raise KafkaSourceError(
                        f"{side} offset {offset} of {tp[0]}/{tp[1]} was deleted (earliest kept is {low}); "
                        "set failOnDataLoss=false to read from the earliest kept offset"
                    )
                return int(low)
            if offset > high:
                raise KafkaSourceError(f"{side} offset {offset} of {tp[0]}/{tp[1]} is after its end {high}")
            return offset

        ranges: list[KafkaRange] = []
        for tp in tps:
            start = resolve(bound_for(starting, tp, EARLIEST), tp, "starting")
            end = resolve(bound_for(ending, tp, LATEST), tp, "ending")
            if end < start:
                raise KafkaSourceError(f"{tp[0]}/{tp[1]}: ending offset {end} is before starting offset {start}")
            if end > start or keep_empty:
                ranges.append(KafkaRange(tp[0], tp[1], start, end))
    finally:
        consumer.close()
    return ranges if keep_empty else split_ranges(ranges, min_partitions, max_records)


def _positive(options: Mapping[str, str], name: str) -> int:
    text = _option(options, name)
    if text is None or not text.strip():
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise KafkaSourceError(f"option {name} must be a positive integer, got {text!r}")
    return value


def split_ranges(ranges: Sequence[KafkaRange], min_partitions: int = 0, max_records: int = 0) -> list[KafkaRange]:
    """Split large ranges into pieces, as Spark 4's KafkaOffsetRangeCalculator does.

    `max_records`: no piece holds more records (a cluster plans a billion records as tasks of a
    bounded size, whatever the Kafka partitioning). `min_partitions`: at least about that many
    pieces in all, each range split in proportion to its size. With both, the larger count wins.
    """
    total = sum(r.end - r.start for r in ranges)
    if total == 0:
        return list(ranges)
    out: list[KafkaRange] = []
    for r in ranges:
        size = r.end - r.start
        parts = 1
        if max_records:
            parts = max(parts, -(-size // max_records))
        if min_partitions > len(ranges):
            parts = max(parts, round(size * min_partitions / total))
        parts = max(1, min(parts, size))
        bounds = [r.start + size * i // parts for i in range(parts)] + [r.end]
        out.extend(KafkaRange(r.topic, r.partition, a, b) for a, b in itertools.pairwise(bounds))
    return out


def arrow_schema(include_headers: bool) -> pa.Schema:
    """kafka_schema() in Arrow types, as Spark converts them (timestamps in microseconds, UTC)."""
    fields = [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("timestampType", pa.int32()),
    ]
    if include_headers:
        fields.append(("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))))
    return pa.schema(fields)


# Java's TimestampType ids (NO_TIMESTAMP_TYPE -1, CREATE_TIME 0, LOG_APPEND_TIME 1) by librdkafka's.
_TS_TYPES = np.full(max(TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME) + 1, -1, dtype=np.int32)
_TS_TYPES[TIMESTAMP_CREATE_TIME] = 0
_TS_TYPES[TIMESTAMP_LOG_APPEND_TIME] = 1


def to_batch(part: KafkaRange, messages: Sequence[Any], schema: pa.Schema) -> pa.RecordBatch:
    """Records of one range (no error messages) as a RecordBatch of the built-in source's schema."""
    n = len(messages)
    stamps = np.array([m.timestamp() for m in messages], dtype=np.int64).reshape(n, 2)
    types = stamps[:, 0]
    columns = [
        pa.array([m.key() for m in messages], pa.binary()),
        pa.array([m.value() for m in messages], pa.binary()),
        pa.repeat(pa.scalar(part.topic, pa.string()), n),
        pa.repeat(pa.scalar(part.partition, pa.int32()), n),
        pa.array([m.offset() for m in messages], pa.int64()),
        # -1 (no timestamp) becomes 1969-12-31T23:59:59.999, as in Java.
        pa.array(stamps[:, 1] * 1000, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        pa.array(_TS_TYPES[np.clip(types, 0, len(_TS_TYPES) - 1)] if n else np.zeros(0, np.int32), pa.int32()),
    ]
    if len(schema) > len(columns):
        # The built-in source gives null, not [], for a record without headers.
        columns.append(pa.array([m.headers() or None for m in messages], schema.field("headers").type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def read_range(options: Mapping[str, str], part: KafkaRange, include_headers: bool) -> Iterator[pa.RecordBatch]:
    """The records of one range as pyarrow RecordBatches of the built-in schema (executor side)."""
    schema = arrow_schema(include_headers)
    poll_timeout_s = int(_option(options, "kafkaConsumer.pollTimeoutMs") or "120000") / 1000
    config = client_config(options)
    config.setdefault("isolation.level", "read_uncommitted")  # the Java client's default, as the built-in
    consumer = Consumer(
        {
            **config,
            "group.id": f"spark-kafka-read-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "fetch.max.bytes": 64 * 1024 * 1024,
        }
    )
    try:
        consumer.assign([TopicPartition(part.topic, part.partition, part.start)])
        pending: list[Any] = []
        last_progress = time.monotonic()
        done = False
        while not done:
            # consume(n, timeout) waits out its whole timeout unless n records come, which made
            # every range's last batch a second late; poll() returns at the first record.
            messages = consumer.consume(10_000, 0)
            if not messages and (first := consumer.poll(1.0)) is not None:
                messages = [first, *consumer.consume(9_999, 0)]
            if not messages:
                if time.monotonic() - last_progress > poll_timeout_s:
                    raise KafkaSourceError(
                        f"no record of {part.topic}/{part.partition} between offsets {part.start} and {part.end} "
                        f"came within kafkaConsumer.pollTimeoutMs={int(poll_timeout_s * 1000)}"
                    )
                continue
            last_progress = time.monotonic()
            errors = [i for i, m in enumerate(messages) if m.error() is not None]
            if errors:
                error = messages[errors[0]].error()
                if error.code() != KafkaError._PARTITION_EOF:
                    raise KafkaSourceError(f"reading {part.topic}/{part.partition}: {error}")
                # The end of what is readable (compaction or aborted transactions at the end).
                messages = messages[: errors[0]]
                done = True
            # One partition's messages come in offset order: cut at the range's end.
            cut = bisect.bisect_left(messages, part.end, key=lambda m: m.offset())
            if cut < len(messages) or (cut and messages[cut - 1].offset() == part.end - 1):
                messages = messages[:cut]
                done = True
            pending.extend(messages)
            if len(pending) >= BATCH_ROWS or (done and pending):
                yield to_batch(part, pending, schema)
                pending = []
    finally:
        consumer.close()


class KafkaReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str], include_headers: bool) -> None:
        self.options = dict(options)
        self.include_headers = include_headers

    def partitions(self) -> Sequence[InputPartition]:
        ranges = plan_ranges(self.options)
        # An empty read still needs one task; a range of zero length yields nothing.
        return ranges or [KafkaRange("", 0, 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if not isinstance(partition, KafkaRange) or partition.end <= partition.start:
            return iter(())
        return read_range(self.options, partition, self.include_headers)


class KafkaPythonSource(DataSource):
    """`spark.read.format("delay_sidecar_kafka")`: Spark's Kafka batch source, in Python."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return kafka_schema(_flag(self.options, "includeHeaders", False))

    def reader(self, schema: StructType) -> DataSourceReader:
        include_headers = any(f.name == "headers" for f in schema.fields)
        return KafkaReader(self.options, include_headers)
