"""The Python Kafka source: the built-in source's schema, options and records, against a real broker."""

import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from confluent_kafka import Producer
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

from sidecar.broker.ports import free_port
from sidecar.errors import SidecarError
from spark.kafka_source import (
    SOURCE_NAME,
    KafkaRange,
    KafkaReader,
    KafkaSourceError,
    arrow_schema,
    plan_ranges,
    split_ranges,
)
from spark.snapshot import existing_topics, topic_partitions
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

    def read(fmt: str = SOURCE_NAME, **options: str) -> list[tuple[object, ...]]:
        reader = spark.read.format(fmt).option("kafka.bootstrap.servers", kafka).option("subscribe", topic)
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
    # The built-in source itself (the shared session has Spark's connector) gives the same rows.
    assert read("kafka", includeHeaders="true") == rows
    offsets = {
        "startingOffsets": json.dumps({topic: {"0": 1, "1": -2}}),
        "endingOffsets": json.dumps({topic: {"0": 3, "1": -1}}),
        "minPartitions": "4",
    }
    ranged = read(**offsets)
    assert [(r[3], r[4]) for r in ranged] == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert read("kafka", **offsets) == ranged
    assert read(startingTimestamp=str(ts + 1)) == []
    with pytest.raises(KafkaSourceError, match="cannot be 'earliest'"):
        plan_ranges({"kafka.bootstrap.servers": kafka, "subscribe": topic, "endingOffsets": "earliest"})
    with pytest.raises(KafkaSourceError, match="does not exist"):
        plan_ranges({"kafka.bootstrap.servers": kafka, "subscribe": "no-such-topic-xyz"})


def test_min_partitions_splits_large_ranges() -> None:
    ranges = split_ranges([KafkaRange("a", 0, 0, 100), KafkaRange("a", 1, 0, 10)], 4)
    assert sum(r.end - r.start for r in ranges) == 110 and len(ranges) >= 4
    assert [(r.start, r.end) for r in ranges if r.partition == 0] == [(0, 25), (25, 50), (50, 75), (75, 100)]


def spans(ranges: list[KafkaRange]) -> list[tuple[str, int, int]]:
    return [(r.topic, r.start, r.end) for r in ranges]


def test_max_records_per_partition_plans_tasks_from_offset_ranges_as_spark_does() -> None:
    # The cases of Spark's KafkaOffsetRangeCalculatorSuite (SPARK-49259).
    assert spans(split_ranges([KafkaRange("t1", 1, 1, 5)], max_records=4)) == [("t1", 1, 5)]
    assert spans(split_ranges([KafkaRange("t1", 1, 1, 6)], max_records=4)) == [("t1", 1, 3), ("t1", 3, 6)]
    three = [KafkaRange("t1", 1, 1, 40), KafkaRange("t2", 1, 1, 50), KafkaRange("t3", 1, 1, 60)]
    assert spans(split_ranges(three, max_records=20)) == [
        ("t1", 1, 20),
        ("t1", 20, 40),
        ("t2", 1, 17),
        ("t2", 17, 33),
        ("t2", 33, 50),
        ("t3", 1, 20),
        ("t3", 20, 40),
        ("t3", 40, 60),
    ]
    assert spans(split_ranges([KafkaRange("t1", 1, 1, 40)], 1, 20)) == [("t1", 1, 20), ("t1", 20, 40)]
    assert spans(split_ranges([KafkaRange("t1", 1, 1, 40)], 4, 20)) == [
        ("t1", 1, 10),
        ("t1", 10, 20),
        ("t1", 20, 30),
        ("t1", 30, 40),
    ]
    # A billion records in 4 Kafka partitions: bounded tasks, offsets neither lost nor read twice.
    huge = [KafkaRange("big", p, 0, 250_000_000) for p in range(4)]
    planned = split_ranges(huge, max_records=1_000_000)
    assert len(planned) == 1000 and max(r.end - r.start for r in planned) == 1_000_000
    assert sum(r.end - r.start for r in planned) == 1_000_000_000
    with pytest.raises(KafkaSourceError, match="maxRecordsPerPartition must be a positive integer"):
        plan_ranges({"kafka.bootstrap.servers": "localhost:1", "subscribe": "t", "maxRecordsPerPartition": "0"})


def test_read_hands_spark_arrow_record_batches_of_the_built_in_schema(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory("arrow")
    for i in range(25):
        kafka_helper.produce(topic, f"v{i}".encode(), headers=[("h", str(i).encode())] if i % 2 else None)
    kafka_helper.flush()
    reader = KafkaReader({"kafka.bootstrap.servers": kafka, "subscribe": topic, "maxRecordsPerPartition": "10"}, True)
    parts = reader.partitions()
    assert [(p.start, p.end) for p in parts if isinstance(p, KafkaRange)] == [(0, 8), (8, 16), (16, 25)]
    batches = [b for p in parts for b in reader.read(p)]
    assert all(isinstance(b, pa.RecordBatch) and b.schema == arrow_schema(True) for b in batches)
    table = pa.Table.from_batches(batches)
    assert table.column("offset").to_pylist() == list(range(25))
    assert table.column("headers").to_pylist()[:2] == [None, [{"key": "h", "value": b"1"}]]
    assert set(table.column("topic").to_pylist()) == {topic} and set(table.column("timestampType").to_pylist()) == {0}


def test_no_python_runs_per_row_in_the_plan_of_a_read(spark: SparkSession, kafka: str) -> None:
    df = (
        spark.read.format(SOURCE_NAME)
        .option("kafka.bootstrap.servers", kafka)
        .option("subscribe", "any")
        .option("includeHeaders", "true")
        .load()
    )
    plan = df.select("offset", "headers.key")._jdf.queryExecution().executedPlan().toString()
    assert "BatchScan delay_sidecar_kafka" in plan and "(Python)" in plan
    assert not any(node in plan for node in ("BatchEvalPython", "ArrowEvalPython", "PythonUDF", "MapInPandas"))


def test_read_committed_leaves_out_aborted_and_open_transactions(
    spark: SparkSession, kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory("txn")
    kafka_helper.produce(topic, b"before")
    kafka_helper.flush()
    producer = Producer({"bootstrap.servers": kafka, "transactional.id": f"audit-test-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"aborted")
    producer.flush()
    producer.abort_transaction(30)
    kafka_helper.produce(topic, b"after")
    kafka_helper.flush()
    producer.begin_transaction()
    producer.produce(topic, b"open")  # still open when the audit reads: not readable committed yet
    producer.flush()
    try:

        def values(isolation: str) -> list[bytes]:
            rows = (
                spark.read.format(SOURCE_NAME)
                .option("kafka.bootstrap.servers", kafka)
                .option("kafka.isolation.level", isolation)
                .option("kafkaConsumer.pollTimeoutMs", "20000")  # a hang would fail, not block the suite
                .option("subscribe", topic)
                .load()
                .orderBy("offset")
                .collect()
            )
            return [bytes(r["value"]) for r in rows]

        assert values("read_committed") == [b"before", b"after"]
        assert values("read_uncommitted") == [b"before", b"aborted", b"after", b"open"]
    finally:
        producer.abort_transaction(30)


def test_the_admin_client_is_not_given_consumer_properties(kafka: str, capfd: pytest.CaptureFixture[str]) -> None:
    """librdkafka prints "isolation.level is a consumer property and will be ignored" otherwise."""
    options = {"kafka.bootstrap.servers": kafka, "kafka.isolation.level": "read_committed"}
    assert isinstance(existing_topics(options), set)
    time.sleep(0.2)  # librdkafka logs from its own threads
    assert "isolation.level" not in capfd.readouterr().err


def test_a_cluster_that_does_not_answer_gets_a_clear_error_naming_it_and_the_wait() -> None:
    """The audit's first request waits 60 s by default (a node that fenced itself after a stall of
    its controller answered nothing for 26 s and more); then it says what it could not reach."""
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(SidecarError, match=rf"cannot reach Kafka at {address} in 2 s: .*--bootstrap-servers"):
        topic_partitions({"kafka.bootstrap.servers": address}, timeout_s=2)
