"""Kafka-source-shaped rows for in-memory DataFrames, with the contract's headers."""

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from sidecar.outbound.records import HeaderForm, dead_letter_headers, outbound_headers
from spark.kafka_source import kafka_schema
from spark.model import AuditResult, AuditRoute

Header = tuple[str, bytes]
Row = tuple[object, ...]


def record(
    topic: str,
    offset: int,
    ts_ms: int,
    headers: Sequence[Header] | None = None,
    partition: int = 0,
    key: bytes | None = b"k",
    value: bytes | None = b"v",
) -> Row:
    stamp = datetime.fromtimestamp(ts_ms / 1000, tz=UTC)
    return (key, value, topic, partition, offset, stamp, 0, list(headers) if headers else None)


def delivered(
    outbound: str,
    out_offset: int,
    delivered_ms: int,
    origin: tuple[str, int, int],
    deliver_at: int,
    redelivery_count: int = 0,
    out_partition: int = 0,
) -> Row:
    # Both header forms in every world: the compact one (the default) on even outbound offsets.
    form: HeaderForm = "compact" if out_offset % 2 == 0 else "v1"
    headers = outbound_headers(None, *origin, deliver_at, redelivery_count, form)
    return record(outbound, out_offset, delivered_ms, headers, partition=out_partition)


def dead_lettered(dlt: str, dlt_offset: int, ts_ms: int, origin: tuple[str, int, int], code: str) -> Row:
    return record(dlt, dlt_offset, ts_ms, dead_letter_headers(None, *origin, code, f"{code} for the test"))


def anomaly_rows(result: AuditResult) -> list[dict[str, Any]]:
    """Every anomaly of an audit as a dict, in one fixed order."""
    rows = result.anomalies.orderBy("kind", "topic", "partition", "offset", "subscription", "outbound_offset")
    return [r.asDict() for r in rows.collect()]


def frame(spark: SparkSession, rows: Sequence[Row]) -> DataFrame:
    return spark.createDataFrame(list(rows), kafka_schema(include_headers=True))


class World:
    """The topics of one in-memory audit: rows per input, and the routes the policies give."""

    def __init__(self) -> None:
        self.inbound: list[Row] = []
        self.outbound: list[Row] = []
        self.dead: list[Row] = []
        self.control: list[Row] = []
        self.control_dead: list[Row] = []
        self.outcomes: list[Row] = []
        self.routes: list[AuditRoute] = []
