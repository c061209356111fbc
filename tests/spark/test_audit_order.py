"""The order check of exclusive and failover subscriptions, on small in-memory DataFrames (no broker).

The promise (contract sections 2 and 4): one inbound partition's records arrive on the outbound
partition of the same number, and in inbound order. Each scenario lives on its own inbound topic of
one synthetic world, audited once (a Spark audit costs seconds even on tiny data).
"""

from collections.abc import Sequence
from typing import Any

import pytest
from pyspark.sql import SparkSession

from spark.analysis import ORDER_BLOCK
from spark.audit import run_audit
from spark.audit_job import with_partition_layout
from spark.model import AuditInputs, AuditParams, AuditResult, AuditRoute, SubscriptionSummary
from spark.report import thresholds_report
from spark.settings import AuditSettings
from tests.spark.records import Row, World, anomaly_rows, dead_lettered, delivered, frame, record

T0 = 1_700_000_000_000
NOW = T0 + 3_600_000
GRACE = 5000
B = ORDER_BLOCK


def ordered(topic: str, sub: str = "excl", same_partitions: bool = True) -> AuditRoute:
    return AuditRoute(topic, sub, f"{topic}.{sub}", f"{topic}.dlt", ordered=True, same_partitions=same_partitions)


def at_once(topic: str, offset: int, out_offset: int, partition: int = 0, out_partition: int | None = None) -> Row:
    """A first delivery at once, as the sidecar writes it for these subscriptions: deliver-at = publish."""
    out = partition if out_partition is None else out_partition
    return delivered(
        f"{topic}.excl", out_offset, T0 + 10 + out_offset, (topic, partition, offset), T0, out_partition=out
    )


def build_world() -> World:
    w = World()
    # split: inbound partition 0 over outbound partitions 0 (offsets 0, 1) and 1 (offsets 2, 3), each in order.
    w.routes.append(ordered("split"))
    w.inbound += [record("split", i, T0) for i in range(4)]
    w.outbound += [at_once("split", 0, 0), at_once("split", 1, 1)]
    w.outbound += [at_once("split", 2, 0, out_partition=1), at_once("split", 3, 1, out_partition=1)]
    # swap (failover): offset 2 written before offset 1. Partition 1 is in order.
    w.routes.append(ordered("swap"))
    w.inbound += [record("swap", i, T0) for i in range(4)] + [record("swap", i, T0, partition=1) for i in range(2)]
    w.outbound += [at_once("swap", o, out) for o, out in ((0, 0), (1, 2), (2, 1), (3, 3))]
    w.outbound += [at_once("swap", o, o, partition=1) for o in range(2)]
    # fine: what the sidecar really writes, which must pass. On partition 0, offsets 2 and 5 were accepted
    # while the subscription was shared: they come at their deliver-at (5 before 2), after the rest. Offset 3
    # asked for an hour of delay, which an exclusive subscription ignores: at once, in order. Offset 1 is
    # redelivered after a nack, offset 8 is dead-lettered. Partition 1 goes to outbound partition 1.
    w.routes.append(ordered("fine"))
    w.inbound += [record("fine", i, T0) for i in (0, 1, 4, 6, 7, 8)]
    w.inbound += [record("fine", 2, T0, [("deliver-after", b"10s")]), record("fine", 5, T0, [("deliver-after", b"5s")])]
    w.inbound.append(record("fine", 3, T0, [("deliver-after", b"1h")]))
    w.inbound += [record("fine", i, T0, partition=1) for i in range(3)]
    w.outbound += [at_once("fine", o, out) for out, o in enumerate((0, 1, 3, 4, 6, 7))]
    w.outbound += [
        delivered("fine.excl", 6, T0 + 5_001, ("fine", 0, 5), T0 + 5_000),
        delivered("fine.excl", 7, T0 + 10_001, ("fine", 0, 2), T0 + 10_000),
        delivered("fine.excl", 8, T0 + 30_001, ("fine", 0, 1), T0 + 30_000, redelivery_count=1),
    ]
    w.outbound += [at_once("fine", o, o, partition=1) for o in range(3)]
    w.dead.append(dead_lettered("fine.dlt", 0, T0, ("fine", 0, 8), "EXCEEDS_RETENTION"))
    # replay: an at-least-once restart wrote offsets 2 and 3 again; their first copies are still in order.
    w.routes.append(ordered("replay"))
    w.inbound += [record("replay", i, T0) for i in range(6)]
    w.outbound += [at_once("replay", o, out) for out, o in enumerate((0, 1, 2, 3, 2, 3, 4, 5))]
    # keyed: the outbound topic has another partition count, so the sidecar partitions by key and one
    # inbound partition spreads over outbound partitions 0 and 1; each one must still be in order, and
    # on outbound partition 1 offset 7 was written before offset 6.
    w.routes.append(ordered("keyed", same_partitions=False))
    w.inbound += [record("keyed", i, T0) for i in range(8)]
    w.outbound += [at_once("keyed", o, out, out_partition=0) for out, o in enumerate((1, 3, 5))]
    w.outbound += [at_once("keyed", o, out, out_partition=1) for out, o in enumerate((0, 2, 4, 7, 6))]
    # blocks: the inversions straddle the blocks the check sorts separately, one across an empty block.
    w.routes.append(ordered("blocks"))
    offsets = (B - 2, B - 1, B, B + 1, 3 * B + 5)
    w.inbound += [record("blocks", o, T0) for o in offsets]
    w.outbound += [at_once("blocks", o, out) for o, out in zip(offsets, (0, 2, 1, 4, 3), strict=True)]
    return w


def audit(spark: SparkSession, w: World) -> AuditResult:
    inputs = AuditInputs(frame(spark, w.inbound), frame(spark, w.outbound), frame(spark, w.dead))
    return run_audit(spark, inputs, w.routes, AuditParams(as_of_ms=NOW, grace_ms=GRACE))


@pytest.fixture(scope="module")
def result(spark: SparkSession) -> AuditResult:
    return audit(spark, build_world())


@pytest.fixture(scope="module")
def all_anomalies(result: AuditResult) -> list[dict[str, Any]]:
    return anomaly_rows(result)


def anomalies_of(rows: Sequence[dict[str, Any]], topic: str) -> list[tuple[Any, ...]]:
    return [
        (r["kind"], r["partition"], r["offset"], r["outbound_partition"], r["outbound_offset"])
        for r in rows
        if r["topic"] == topic
    ]


def summary(result: AuditResult, topic: str) -> SubscriptionSummary:
    [s] = [s for s in result.subscriptions if (s.topic, s.subscription) == (topic, "excl")]
    return s


def test_a_partition_split_over_two_outbound_partitions_is_one_anomaly_per_misplaced_record(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    assert anomalies_of(all_anomalies, "split") == [("wrong_partition", 0, 2, 1, 0), ("wrong_partition", 0, 3, 1, 1)]
    [detail] = {r["detail"] for r in all_anomalies if r["topic"] == "split"}
    assert detail == "on outbound partition 1, not 0 (the topics have as many partitions)"
    s = summary(result, "split")
    assert (s.delivered, s.missing, s.wrong_partition, s.out_of_order) == (4, 0, 2, 0)


def test_a_record_written_before_its_inbound_predecessor_is_out_of_order(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    assert anomalies_of(all_anomalies, "swap") == [("out_of_order", 0, 2, 0, 1)]
    [row] = [r for r in all_anomalies if r["topic"] == "swap"]
    assert row["detail"] == "written before inbound offset 1, which precedes it (outbound offset 2)"
    assert (row["subscription"], row["redelivery_count"], row["publish_ms"]) == ("excl", 0, T0)
    assert (summary(result, "swap").out_of_order, summary(result, "swap").wrong_partition) == (1, 0)


def test_delayed_records_nack_redeliveries_and_dead_letters_interleaved_pass(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    assert anomalies_of(all_anomalies, "fine") == []
    s = summary(result, "fine")
    assert (s.inbound, s.rejected, s.delivered, s.missing, s.redelivered) == (12, 1, 11, 0, 1)
    assert (s.out_of_order, s.wrong_partition, s.duplicates, s.early, s.late) == (0, 0, 0, 0, 0)


def test_an_at_least_once_replay_is_duplicates_not_disorder(all_anomalies: list[dict[str, Any]]) -> None:
    assert anomalies_of(all_anomalies, "replay") == [("duplicate", 0, 2, 0, 4), ("duplicate", 0, 3, 0, 5)]


def test_a_keyed_outbound_topic_may_spread_a_partition_but_keeps_each_outbound_partition_in_order(
    all_anomalies: list[dict[str, Any]],
) -> None:
    assert anomalies_of(all_anomalies, "keyed") == [("out_of_order", 0, 7, 1, 3)]


def test_inversions_across_the_sorted_blocks_are_found(all_anomalies: list[dict[str, Any]]) -> None:
    assert anomalies_of(all_anomalies, "blocks") == [("out_of_order", 0, B, 0, 1), ("out_of_order", 0, 3 * B + 5, 0, 3)]
    [across_empty] = [r["detail"] for r in all_anomalies if r["offset"] == 3 * B + 5]
    assert across_empty == f"written before inbound offset {B + 1}, which precedes it (outbound offset 4)"


def test_order_anomalies_count_and_fail_the_audit_like_the_others(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    assert result.anomaly_counts == {
        "missing": 0,
        "nack_missing": 0,
        "duplicate": 2,
        "rejected_and_delivered": 0,
        "early": 0,
        "late": 0,
        "out_of_order": 4,  # swap, keyed, blocks twice
        "wrong_partition": 2,  # split
        "delivered_after_cancel": 0,
        "rescheduled_early": 0,
        "delivered_replaced": 0,  # keyed topics: tests/spark/test_audit_keys.py
    }
    assert len(all_anomalies) == sum(result.anomaly_counts.values())
    thresholds, passed = thresholds_report(result, AuditSettings(max_duplicates=2))
    assert thresholds["out_of_order"] == {"limit": 0, "actual": 6, "exceeded": True} and not passed
    _, passed = thresholds_report(result, AuditSettings(max_duplicates=2, max_out_of_order=6))
    assert passed


def test_only_exclusive_and_failover_subscriptions_are_checked(spark: SparkSession) -> None:
    """The same disorder on a shared subscription is not an order anomaly: it was never promised."""
    w = World()
    w.routes.append(AuditRoute("swap", "excl", "swap.excl", "swap.dlt"))
    w.inbound += [record("swap", i, T0) for i in range(3)]
    w.outbound += [at_once("swap", o, out) for o, out in ((0, 0), (1, 2), (2, 1))]
    result = audit(spark, w)
    assert result.anomaly_counts == dict.fromkeys(result.anomaly_counts, 0)


def test_the_job_learns_from_the_partition_counts_whether_an_outbound_topic_is_keyed() -> None:
    routes = [ordered("a"), ordered("b"), ordered("c")]
    partitions = {"a": 4, "a.excl": 4, "b": 4, "b.excl": 2, "c": 4}
    assert [r.same_partitions for r in with_partition_layout(routes, partitions)] == [True, False, True]
