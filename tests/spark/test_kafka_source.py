"""The Python Kafka source: the built-in source's schema, options and records, against a real broker."""

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from pyspark.sql import SparkSession
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

from spark.kafka_source import SOURCE_NAME, KafkaRange, KafkaSourceError, plan_ranges, split_ranges
from tests.kafka_helpers import KafkaHelper

# Spark's KafkaRecordToRowConverter.kafkaSchema (+ headersType with includeHeaders=true), written out.
BUILT_IN_FIELDS = [
    StructField("key", BinaryType(), True),
    StructField("value", BinaryType(), True),
    StructField("topic", StringType(), True),
    StructField("partition", IntegerType(), True),
    StructField("offset", LongType(), True),
    StructField("timestamp", TimestampType(), True),
    StructField("timestampType", IntegerType(), True),
]
BUILT_IN_HEADERS = StructField(
    "headers",
    ArrayType(StructType([StructField("key", StringType(), True), StructField("value", BinaryType(), True)]), True),
    True,
)


@pytest.mark.parametrize("include_headers", [True, False])
def test_schema_equals_the_built_in_kafka_source_field_by_field(spark: SparkSession, include_headers: bool) -> None:
    df = (
        spark.read.format(SOURCE_NAME)
        .option("kafka.bootstrap.servers", "localhost:1")  # load() plans nothing: no broker is contacted
        .option("subscribe", "t")
        .option("includeHeaders", str(include_headers).lower())
        .load()
    )
    expected = StructType(BUILT_IN_FIELDS + ([BUILT_IN_HEADERS] if include_headers else []))
    assert [f.name for f in df.schema.fields] == [f.name for f in expected.fields]
    for got, want in zip(df.schema.fields, expected.fields, strict=True):
        assert (got.name, got.dataType, got.nullable) == (want.name, want.dataType, want.nullable)
    assert df.schema == expected
    assert df.schema.simpleString() == (
        "struct<key:binary,value:binary,topic:string,partition:int,offset:bigint,timestamp:timestamp,"
        "timestampType:int" + (",headers:array<struct<key:string,value:binary>>>" if include_headers else ">")
    )


def test_reads_records_and_honours_offsets_like_the_built_in_source(
    spark: SparkSession, kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory("src", partitions=2)
    ts = int(time.time() * 1000) - 60_000  # recent: the broker's retention keeps it
    for i in range(10):
        headers = [("h", b"x"), ("h", None)] if i == 0 else None
        kafka_helper.produce(topic, f"v{i}".encode(), None if i % 2 else b"k", headers, partition=i % 2, timestamp=ts)
    kafka_helper.flush()

    def read(**options: str) -> list[tuple[object, ...]]:
        reader = spark.read.format(SOURCE_NAME).option("kafka.bootstrap.servers", kafka).option("subscribe", topic)
        for key, value in options.items():
            reader = reader.option(key, value)
        rows = reader.load().orderBy("partition", "offset").collect()
        return [tuple(r) for r in rows]

    rows = read(includeHeaders="true")
    assert len(rows) == 10
    assert rows[0] == (
        b"k",
        b"v0",
        topic,
        0,
        0,
        datetime.fromtimestamp(ts / 1000, UTC).replace(tzinfo=None),
        0,
        [
            ("h", b"x"),
            ("h", None),
        ],
    )
    assert rows[5][:5] == (None, b"v1", topic, 1, 0) and rows[5][7] is None  # no headers: null, as the built-in
    ranged = read(
        startingOffsets=json.dumps({topic: {"0": 1, "1": -2}}),
        endingOffsets=json.dumps({topic: {"0": 3, "1": -1}}),
        minPartitions="4",
    )
    assert [(r[3], r[4]) for r in ranged] == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert read(startingTimestamp=str(ts + 1)) == []
    with pytest.raises(KafkaSourceError, match="cannot be 'earliest'"):
        plan_ranges({"kafka.bootstrap.servers": kafka, "subscribe": topic, "endingOffsets": "earliest"})
    with pytest.raises(KafkaSourceError, match="does not exist"):
        plan_ranges({"kafka.bootstrap.servers": kafka, "subscribe": "no-such-topic-xyz"})


def test_min_partitions_splits_large_ranges() -> None:
    ranges = split_ranges([KafkaRange("a", 0, 0, 100), KafkaRange("a", 1, 0, 10)], 4)
    assert sum(r.end - r.start for r in ranges) == 110 and len(ranges) >= 4
    assert [(r.start, r.end) for r in ranges if r.partition == 0] == [(0, 25), (25, 50), (50, 75), (75, 100)]
