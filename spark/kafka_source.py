"""A Spark batch data source over confluent-kafka with the schema and options of Spark's built-in `kafka`.

Spark's own Kafka source lives in the spark-sql-kafka-0-10 connector, which comes from Maven
(`--packages`); where that cannot be downloaded, this Python data source (pyspark.sql.datasource)
reads the same records into the same schema, so code written against one runs on the other:

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
* `includeHeaders` (default false), `failOnDataLoss` (default true), `minPartitions` (split large
  ranges), `kafkaConsumer.pollTimeoutMs` (default 120000).

One Spark partition (InputPartition) per Kafka topic-partition offset range, as the built-in source
plans it, so the read runs in parallel on a cluster. Records are handed to Spark as Arrow batches.

This module imports nothing of the sidecar: executors need only pyspark, pyarrow and confluent-kafka.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    min_partitions = int(_option(options, "minPartitions") or "0")
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
    return ranges if keep_empty else split_ranges(ranges, min_partitions)


def split_ranges(ranges: Sequence[KafkaRange], min_partitions: int) -> list[KafkaRange]:
    """Split the larger ranges so there are at least `min_partitions` tasks (like the built-in source)."""
    total = sum(r.end - r.start for r in ranges)
    if min_partitions <= len(ranges) or total == 0:
        return list(ranges)
    out: list[KafkaRange] = []
    for r in ranges:
        size = r.end - r.start
        parts = max(1, round(size * min_partitions / total))
        step = -(-size // parts)
        out.extend(KafkaRange(r.topic, r.partition, s, min(s + step, r.end)) for s in range(r.start, r.end, step))
    return out


def read_range(options: Mapping[str, str], part: KafkaRange, include_headers: bool) -> Iterator[Any]:
    """The records of one range as pyarrow RecordBatches of the built-in schema (executor side)."""
    header_type = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
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
        fields.append(("headers", header_type))
    schema = pa.schema(fields)
    # Java's TimestampType ids (CREATE_TIME 0, LOG_APPEND_TIME 1, NO_TIMESTAMP_TYPE -1), as the built-in reports.
    ts_types = {TIMESTAMP_CREATE_TIME: 0, TIMESTAMP_LOG_APPEND_TIME: 1}
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
        columns: list[list[Any]] = [[] for _ in fields]
        keys, values, topics, partitions, offsets, stamps, stamp_types = columns[:7]
        headers_col = columns[7] if include_headers else None
        last_progress = time.monotonic()
        done = False
        while not done:
            messages = consumer.consume(10_000, 1.0)
            if not messages:
                if time.monotonic() - last_progress > poll_timeout_s:
                    raise KafkaSourceError(
                        f"no record of {part.topic}/{part.partition} between offsets {part.start} and {part.end} "
                        f"came within kafkaConsumer.pollTimeoutMs={int(poll_timeout_s * 1000)}"
                    )
                continue
            last_progress = time.monotonic()
            for m in messages:
                error = m.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        done = True  # the end of what is readable (compaction or aborted transactions at the end)
                        break
                    raise KafkaSourceError(f"reading {part.topic}/{part.partition}: {error}")
                offset = m.offset()
                if offset >= part.end:
                    done = True
                    break
                ts_type, ts = m.timestamp()
                keys.append(m.key())
                values.append(m.value())
                topics.append(part.topic)
                partitions.append(part.partition)
                offsets.append(offset)
                stamps.append(ts * 1000)  # -1 (no timestamp) becomes 1969-12-31T23:59:59.999, as in Java
                stamp_types.append(ts_types.get(ts_type, -1))
                if headers_col is not None:
                    raw = m.headers()
                    headers_col.append(raw or None)  # the built-in gives null, not [], for no headers
                if offset == part.end - 1:
                    done = True
                    break
            if len(offsets) >= BATCH_ROWS or (done and offsets):
                yield pa.RecordBatch.from_arrays(
                    [pa.array(col, type=f[1]) for col, f in zip(columns, fields, strict=True)], schema=schema
                )
                for col in columns:
                    col.clear()
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
