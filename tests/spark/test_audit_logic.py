"""The pure audit logic on small in-memory DataFrames (no broker).

Spark jobs cost seconds even on tiny data, so the scenarios share one audit: each lives on its own
inbound topic of one synthetic "world", and each test reads its topic's part of the result.
"""

import json
from collections.abc import Sequence
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F  # noqa: N812

from spark.audit import run_audit
from spark.columns import with_requested_deliver_at
from spark.model import AuditInputs, AuditParams, AuditResult, AuditRoute, SubscriptionSummary
from tests.spark.records import Row, World, anomaly_rows, dead_lettered, delivered, frame, record

T0 = 1_700_000_000_000
NOW = T0 + 3_600_000
GRACE = 5000
CONTROL = "delay-sidecar.control"
OWN_CONTROL = "own.control"


def two_subs(topic: str) -> list[AuditRoute]:
    return [AuditRoute(topic, sub, f"{topic}.{sub}", f"{topic}.dlt") for sub in ("billing", "shipping")]


def one_sub(topic: str) -> list[AuditRoute]:
    return [AuditRoute(topic, "billing", f"{topic}.billing", f"{topic}.dlt")]


def both(topic: str, offset: int, delivered_ms: int, deliver_at: int, partition: int = 0) -> list[Row]:
    return [
        delivered(f"{topic}.{sub}", offset, delivered_ms, (topic, partition, offset), deliver_at)
        for sub in ("billing", "shipping")
    ]


def nack(offset: int, ts_ms: int, topic: str, origin_offset: int, delay_ms: int, control: str = CONTROL) -> Row:
    body = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0}
    body |= {"offset": origin_offset, "delay_ms": delay_ms}
    return record(control, offset, ts_ms, value=json.dumps(body).encode())


def accepted(offset: int, ts_ms: int, topic: str, origin_offset: int, redelivery_count: int) -> Row:
    body = {"type": "accepted", "subscription": "billing", "topic": topic, "partition": 0, "offset": origin_offset}
    body |= {"deliver_at": ts_ms + 30_000, "redelivery_count": redelivery_count}
    body |= {"command_partition": 0, "command_offset": offset - 7}
    return record(CONTROL, offset, ts_ms, value=json.dumps(body).encode())


def build_world() -> World:
    w = World()
    # ok: ten records, one second of delay, delivered 0..90 ms late on both subscriptions.
    w.routes += two_subs("ok")
    w.inbound += [record("ok", i, T0, [("deliver-after", b"1s")]) for i in range(10)]
    w.outbound += [row for i in range(10) for row in both("ok", i, T0 + 1000 + i * 10, T0 + 1000)]
    # A cancel's request and fact that sidecars write into an inbound partition: not messages.
    w.inbound += [record("ok", 10 + i, T0, [("delay-command-by", b"g"), (name, b"{}")])
                  for i, name in enumerate(("delay-command", "delay-command-fact"))]  # fmt: skip
    # gap: 0 due long ago and only on billing (missing on shipping); 1 due within the grace; 2 due tomorrow.
    w.routes += two_subs("gap")
    w.inbound += [
        record("gap", 0, T0),
        record("gap", 1, NOW - 1000),
        record("gap", 2, T0, [("deliver-at", str(NOW + 86_400_000).encode())]),
    ]
    w.outbound.append(delivered("gap.billing", 0, T0 + 5, ("gap", 0, 0), T0))
    # dup: billing got two extra copies of partition 1 offset 0.
    w.routes += two_subs("dup")
    w.inbound.append(record("dup", 0, T0, partition=1))
    w.outbound += both("dup", 0, T0 + 10, T0, partition=1)
    w.outbound += [delivered("dup.billing", o, T0 + 20, ("dup", 1, 0), T0) for o in (7, 8)]
    # early: shipping delivered a second before the deliver-at.
    w.routes += two_subs("early")
    w.inbound.append(record("early", 0, T0, [("deliver-after", b"10s")]))
    w.outbound += [
        delivered("early.billing", 0, T0 + 10_000, ("early", 0, 0), T0 + 10_000),
        delivered("early.shipping", 0, T0 + 9_000, ("early", 0, 0), T0 + 10_000),
    ]
    # late: a minute late on both, beyond the grace.
    w.routes += two_subs("late")
    w.inbound.append(record("late", 0, T0))
    w.outbound += both("late", 0, T0 + 60_000, T0)
    # past: a deliver-at a day in the past is delivered at once; lateness counts from publish.
    w.routes += two_subs("past")
    w.inbound.append(record("past", 0, T0, [("deliver-at", str(T0 - 86_400_000).encode())]))
    w.outbound += both("past", 0, T0 + 7, T0 - 86_400_000)
    # rej: two rejections with codes, nothing on the outbound topic.
    w.routes += one_sub("rej")
    w.inbound += [record("rej", 0, T0, [("deliver-after", b"soon")]), record("rej", 1, T0, [("deliver-after", b"99d")])]
    w.dead += [
        dead_lettered("rej.dlt", 0, T0, ("rej", 0, 0), "INVALID_DELAY_HEADER"),
        dead_lettered("rej.dlt", 1, T0, ("rej", 0, 1), "EXCEEDS_MAX_DELAY"),
    ]
    # fate: 0 dead-lettered and delivered; 1 dead-lettered twice.
    w.routes += two_subs("fate")
    w.inbound += [record("fate", 0, T0), record("fate", 1, T0)]
    w.dead += [
        dead_lettered("fate.dlt", 0, T0, ("fate", 0, 0), "EXCEEDS_RETENTION"),
        dead_lettered("fate.dlt", 1, T0, ("fate", 0, 1), "EXCEEDS_RETENTION"),
        dead_lettered("fate.dlt", 2, T0, ("fate", 0, 1), "EXCEEDS_RETENTION"),
    ]
    w.outbound += both("fate", 0, T0 + 5, T0)
    # orphan: outbound records of offset 4, which the audit does not cover.
    w.routes += two_subs("orphan")
    w.inbound.append(record("orphan", 5, T0))
    w.outbound += [*both("orphan", 5, T0 + 1, T0), *both("orphan", 4, T0 + 1, T0)]
    # policy: nothing delivered; pending or missing shows the expected deliver-at of each route.
    w.inbound.append(record("policy", 0, NOW - 10_000, [("deliver-after", b"1h")]))
    w.routes += [
        AuditRoute("policy", "fixed", "p.f", "policy.dlt", fixed_delay_ms=60_000),  # due NOW + 50 s: pending
        AuditRoute("policy", "short-fixed", "p.sf", "policy.dlt", fixed_delay_ms=1000),  # due NOW - 9 s: missing
        AuditRoute("policy", "header", "p.h", "policy.dlt"),  # due NOW + 50 min: pending
        AuditRoute("policy", "ordered", "p.o", "policy.dlt", ordered=True),  # at once: missing
        AuditRoute("policy", "off", "p.x", "policy.dlt", delays_enabled=False),  # at once: missing
    ]
    # nack: 0 redelivered 30 s later (+20 ms); 1 never redelivered (missing); 2 nacked for tomorrow
    # (pending); 3 refused (on the control dead-letter topic, so not expected).
    w.routes += one_sub("nack")
    w.inbound += [record("nack", i, T0) for i in range(4)]
    w.outbound += [delivered("nack.billing", i, T0 + 1, ("nack", 0, i), T0) for i in range(4)]
    w.outbound.append(delivered("nack.billing", 10, T0 + 30_020, ("nack", 0, 0), T0 + 30_000, redelivery_count=1))
    w.control += [
        nack(0, T0, "nack", 0, 30_000),
        nack(1, T0, "nack", 1, 30_000),
        nack(2, T0, "nack", 2, 86_400_000),
        nack(3, T0, "nack", 3, 30_000),
        record(CONTROL, 4, T0, value=b"not json"),
        # The sidecar's own record of an accepted nack shares the topic: it is not a consumer's command.
        accepted(7, T0, "nack", 0, 1),
        accepted(8, T0, "nack", 2, 1),
    ]
    w.control_dead += [
        dead_lettered(f"{CONTROL}.dlt", 0, T0, (CONTROL, 0, 3), "EXCEEDS_MAX_DELAY"),
        dead_lettered(f"{CONTROL}.dlt", 1, T0, (CONTROL, 0, 4), "INVALID_COMMAND"),
    ]
    # own: a topic with its own control topic (policy control_topic). Its nack at control offset 3 is
    # accepted and redelivered (the default control topic's offset 3 was refused: not this one); the
    # one at offset 5 was refused there, on its own control dead-letter topic.
    w.routes.append(AuditRoute("own", "billing", "own.billing", "own.dlt", control_topic=OWN_CONTROL))
    w.inbound += [record("own", i, T0) for i in range(2)]
    w.outbound += [delivered("own.billing", i, T0 + 1, ("own", 0, i), T0) for i in range(2)]
    w.outbound.append(delivered("own.billing", 2, T0 + 30_010, ("own", 0, 0), T0 + 30_000, redelivery_count=1))
    w.control += [nack(3, T0, "own", 0, 30_000, OWN_CONTROL), nack(5, T0, "own", 1, 30_000, OWN_CONTROL)]
    w.control_dead.append(dead_lettered(f"{OWN_CONTROL}.dlt", 0, T0, (OWN_CONTROL, 0, 5), "WRONG_CONTROL_TOPIC"))
    # renack: redelivered after the first nack, then nacked again: the second nack got no redelivery.
    w.routes += one_sub("renack")
    w.inbound.append(record("renack", 0, T0))
    w.outbound += [
        delivered("renack.billing", 0, T0 + 1, ("renack", 0, 0), T0),
        delivered("renack.billing", 1, T0 + 1_010, ("renack", 0, 0), T0 + 1000, redelivery_count=1),
    ]
    w.control += [nack(5, T0, "renack", 0, 1000), nack(6, T0 + 5000, "renack", 0, 1000)]
    # cx: cancels and reschedules (contract section 5), read from the outcomes topic.
    w.routes += two_subs("cx")
    w.inbound += [record("cx", i, T0, [("deliver-after", b"10s")]) for i in range(5)]
    moved = T0 + 20_000
    w.outcomes += [
        outcome(0, "cancelled", "cx", 0, ["billing", "shipping"]),  # 0: cancelled, never delivered
        outcome(1, "cancelled", "cx", 1, ["billing"]),  # 1: cancelled for billing, delivered anyway
        outcome(2, "rescheduled", "cx", 2, ["billing", "shipping"], moved),  # 2: moved, on time
        outcome(3, "rescheduled", "cx", 3, ["billing"], moved),  # 3: moved for billing, went at the old time
        outcome(4, "rescheduled", "cx", 4, ["billing", "shipping"], moved),  # 4: moved, then cancelled
        outcome(5, "cancelled", "cx", 4, ["billing", "shipping"]),
        outcome(6, "too-late", "cx", 0, []),  # answers that changed nothing are not overrides
    ]
    # nc: delivered, nacked at control offset 20, then cancelled (command at 21): the cancel took the
    # nack's redelivery back, so nothing more is owed, and the first delivery is no anomaly.
    w.routes += one_sub("nc")
    w.inbound.append(record("nc", 0, T0))
    w.outbound.append(delivered("nc.billing", 0, T0 + 1, ("nc", 0, 0), T0))
    w.control.append(nack(20, T0, "nc", 0, 30_000))
    w.outcomes.append(outcome(21, "cancelled", "nc", 0, ["billing"], nacks=["billing"]))
    w.outbound += both("cx", 1, T0 + 10_005, T0 + 10_000)
    w.outbound += both("cx", 2, moved + 5, moved)
    w.outbound += both("cx", 3, T0 + 10_005, T0 + 10_000)
    return w


def outcome(
    position: int, kind: str, topic: str, offset: int, subs: list[str], deliver_at: int | None = None,
    nacks: list[str] | None = None,
) -> Row:  # fmt: skip
    body = {"v": 1, "outcome": kind, "type": "reschedule" if deliver_at else "cancel", "topic": topic,
            "partition": 0, "offset": offset, "subscriptions": subs, "deliver_at": deliver_at,
            "command": {"partition": 0, "offset": position}, "nacks": nacks}  # fmt: skip
    return record(f"{CONTROL}.outcomes", position, T0 + 1_000, value=json.dumps(body).encode())


def audit(spark: SparkSession, w: World, **params: Any) -> AuditResult:
    inputs = AuditInputs(
        frame(spark, w.inbound),
        frame(spark, w.outbound),
        frame(spark, w.dead),
        frame(spark, w.control),
        frame(spark, w.control_dead),
        control_topics=(CONTROL, OWN_CONTROL),
        outcomes=frame(spark, w.outcomes),
    )
    return run_audit(spark, inputs, w.routes, AuditParams(**{"as_of_ms": NOW, "grace_ms": GRACE, **params}))


@pytest.fixture(scope="module")
def result(spark: SparkSession) -> AuditResult:
    return audit(spark, build_world())


@pytest.fixture(scope="module")
def all_anomalies(result: AuditResult) -> list[dict[str, Any]]:
    return anomaly_rows(result)


def summary(result: AuditResult, topic: str, subscription: str = "billing") -> SubscriptionSummary:
    [s] = [s for s in result.subscriptions if (s.topic, s.subscription) == (topic, subscription)]
    return s


def anomalies_of(rows: Sequence[dict[str, Any]], topic: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["topic"] == topic]


def test_everything_delivered_on_time_has_no_anomaly_and_lateness_percentiles(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    assert anomalies_of(all_anomalies, "ok") == []
    for sub in ("billing", "shipping"):
        s = summary(result, "ok", sub)
        assert (s.inbound, s.rejected, s.accepted, s.delivered, s.pending, s.missing) == (10, 0, 10, 10, 0, 0)
        assert (s.duplicates, s.early, s.late, s.redelivered, s.nacks) == (0, 0, 0, 0, 0)
        assert s.lateness_p50_ms == pytest.approx(45)
        assert s.lateness_max_ms == 90
        assert s.lateness_p99_ms is not None and 89 <= s.lateness_p99_ms <= 90
    json.dumps(result.as_json())  # the report serialises


def test_missing_and_pending_are_told_apart_by_deliver_at_plus_grace(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    billing, shipping = summary(result, "gap", "billing"), summary(result, "gap", "shipping")
    assert (billing.delivered, billing.pending, billing.missing) == (1, 2, 0)
    assert (shipping.delivered, shipping.pending, shipping.missing) == (0, 2, 1)
    [missing] = anomalies_of(all_anomalies, "gap")
    assert missing["kind"] == "missing"
    assert (missing["partition"], missing["offset"], missing["subscription"]) == (0, 0, "shipping")
    assert missing["deliver_at_ms"] == T0


def test_duplicate_delivery_is_one_anomaly_per_extra_copy_with_its_outbound_offset(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    dups = anomalies_of(all_anomalies, "dup")
    assert [(d["kind"], d["subscription"], d["partition"], d["offset"], d["outbound_offset"]) for d in dups] == [
        ("duplicate", "billing", 1, 0, 7),
        ("duplicate", "billing", 1, 0, 8),
    ]
    assert (summary(result, "dup").duplicates, summary(result, "dup").delivered) == (2, 1)
    assert {d["publish_ms"] for d in dups} == {T0}  # the origin's publish time, to find it by time


def test_early_delivery_is_reported_with_how_early(result: AuditResult, all_anomalies: list[dict[str, Any]]) -> None:
    [early] = anomalies_of(all_anomalies, "early")
    assert (early["kind"], early["subscription"], early["offset"], early["lateness_ms"]) == (
        "early",
        "shipping",
        0,
        -1000,
    )
    assert early["detail"] == "delivered 1000 ms early"
    assert (early["publish_ms"], early["deliver_at_ms"], early["delivered_ms"]) == (T0, T0 + 10_000, T0 + 9_000)
    assert summary(result, "early", "shipping").early == 1


def test_late_beyond_grace_is_reported(result: AuditResult, all_anomalies: list[dict[str, Any]]) -> None:
    assert [a["kind"] for a in anomalies_of(all_anomalies, "late")] == ["late", "late"]
    assert summary(result, "late").late == 1 and summary(result, "late").lateness_max_ms == 60_000


def test_deliver_at_in_the_past_counts_lateness_from_publish(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    assert summary(result, "past").lateness_max_ms == 7
    assert anomalies_of(all_anomalies, "past") == []


def test_rejections_are_counted_by_code_and_not_expected_on_outbound(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    s = summary(result, "rej")
    assert (s.inbound, s.rejected, s.accepted, s.missing, s.pending) == (2, 2, 0, 0, 0)
    assert [r for r in result.rejections if r["topic"] == "rej"] == [
        {"topic": "rej", "code": "EXCEEDS_MAX_DELAY", "count": 1},
        {"topic": "rej", "code": "INVALID_DELAY_HEADER", "count": 1},
    ]
    assert anomalies_of(all_anomalies, "rej") == []
    rejected = {
        (r["topic"], r["partition"], r["offset"], r["code"], r["dlt_topic"], r["dlt_offset"])
        for r in result.rejected_records.where(F.col("topic") == "rej").collect()
    }
    assert rejected == {
        ("rej", 0, 0, "INVALID_DELAY_HEADER", "rej.dlt", 0),
        ("rej", 0, 1, "EXCEEDS_MAX_DELAY", "rej.dlt", 1),
    }


def test_dead_lettered_and_delivered_or_dead_lettered_twice_are_anomalies(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    kinds = [
        (a["kind"], a["offset"], a["subscription"], a["outbound_offset"]) for a in anomalies_of(all_anomalies, "fate")
    ]
    assert kinds == [
        ("duplicate", 1, "(dead-letter)", 2),
        ("rejected_and_delivered", 0, "billing", 0),
        ("rejected_and_delivered", 0, "shipping", 0),
    ]


def test_outbound_of_records_outside_the_audit_are_orphans_not_anomalies(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    assert anomalies_of(all_anomalies, "orphan") == []
    assert {t: n for t, n in result.orphans.items() if t.startswith("orphan.")} == {
        "orphan.billing": 1,
        "orphan.shipping": 1,
    }


def test_policy_fixed_delay_disabled_and_ordered_subscriptions_set_the_expected_deliver_at(result: AuditResult) -> None:
    status = {s.subscription: (s.pending, s.missing) for s in result.subscriptions if s.topic == "policy"}
    assert status == {"fixed": (1, 0), "short-fixed": (0, 1), "header": (1, 0), "ordered": (0, 1), "off": (0, 1)}


def test_nack_redeliveries_are_counted_with_their_lateness_and_missing_ones_reported(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    s = summary(result, "nack")
    assert (s.delivered, s.redelivered, s.redelivery_lateness_max_ms, s.redelivery_lateness_p50_ms) == (4, 1, 20, 20)
    assert (s.nacks, s.nacks_pending, s.nacks_missing) == (3, 1, 1)
    [missing] = anomalies_of(all_anomalies, "nack")
    assert (missing["kind"], missing["offset"], missing["subscription"]) == ("nack_missing", 1, "billing")
    assert missing["deliver_at_ms"] == T0 + 30_000
    assert result.control_rejections == [
        {"code": "EXCEEDS_MAX_DELAY", "count": 1},
        {"code": "INVALID_COMMAND", "count": 1},
        {"code": "WRONG_CONTROL_TOPIC", "count": 1},
    ]


def test_a_cancel_of_a_nacked_record_takes_its_redelivery_back(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    s = summary(result, "nc")
    assert (s.delivered, s.nacks, s.redelivered, s.nacks_missing, s.nacks_pending) == (1, 1, 0, 0, 0)
    assert anomalies_of(all_anomalies, "nc") == []


def test_nacks_on_a_topics_own_control_topic_are_audited_with_its_refusals(result: AuditResult) -> None:
    s = summary(result, "own")
    assert (s.delivered, s.nacks, s.redelivered, s.nacks_missing) == (2, 1, 1, 0)


def test_a_redelivery_before_the_latest_nack_does_not_honour_it(result: AuditResult) -> None:
    s = summary(result, "renack")
    assert (s.nacks, s.nacks_missing, s.redelivered) == (2, 1, 1)


def test_every_anomaly_has_the_publish_time_of_its_origin(all_anomalies: list[dict[str, Any]]) -> None:
    assert [a for a in all_anomalies if a["publish_ms"] is None] == []


def test_the_timeline_has_lateness_per_subscription_and_anomalies_per_kind_by_publish_time(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    timeline = result.timeline
    assert timeline is not None and timeline.bucket_ms == 60_000  # an hour of publish times in minutes
    ok = [r for r in timeline.lateness if (r["topic"], r["subscription"]) == ("ok", "billing")]
    assert ok == [
        {
            "topic": "ok",
            "subscription": "billing",
            "bucket_ms": T0 - T0 % 60_000,
            "delivered": 10,
            "p50_ms": 45.0,
            "p99_ms": pytest.approx(89.1),
            "max_ms": 90,
        }
    ]
    per_kind: dict[str, int] = {}
    for row in timeline.anomalies:
        per_kind[row["kind"]] = per_kind.get(row["kind"], 0) + row["count"]
    assert per_kind == {k: n for k, n in result.anomaly_counts.items() if n}
    assert len(all_anomalies) == sum(per_kind.values())


def test_no_python_runs_per_row_in_the_audit_plan(result: AuditResult) -> None:
    plan = result.anomalies._jdf.queryExecution().executedPlan().toString()
    assert "InMemoryTableScan" in plan  # the cached inputs
    assert not any(node in plan for node in ("BatchEvalPython", "ArrowEvalPython", "PythonUDF", "MapInPandas"))


def test_anomaly_counts_add_up_over_the_world(result: AuditResult, all_anomalies: list[dict[str, Any]]) -> None:
    by_kind: dict[str, int] = {}
    for a in all_anomalies:
        by_kind[a["kind"]] = by_kind.get(a["kind"], 0) + 1
    assert result.anomaly_counts == {
        "missing": 4,  # gap/shipping and policy short-fixed, ordered, off
        "nack_missing": 2,
        "duplicate": 3,
        "rejected_and_delivered": 2,
        "early": 1,
        "late": 2,
        "out_of_order": 0,  # the order check: tests/spark/test_audit_order.py
        "wrong_partition": 0,
        "delivered_after_cancel": 1,  # cx/1
        "rescheduled_early": 1,  # cx/3
        "delivered_replaced": 0,  # keyed topics: tests/spark/test_audit_keys.py
    }
    assert by_kind == {k: n for k, n in result.anomaly_counts.items() if n}


def test_time_range_limits_the_audited_inbound_records(spark: SparkSession) -> None:
    w = World()
    w.routes += one_sub("range")
    w.inbound += [record("range", 0, T0), record("range", 1, T0 + 1000), record("range", 2, T0 + 2000)]
    w.outbound.append(delivered("range.billing", 0, T0 + 1001, ("range", 0, 1), T0 + 1000))
    result = audit(spark, w, from_ms=T0 + 500, to_ms=T0 + 1500)
    [s] = result.subscriptions
    assert (s.inbound, s.delivered, s.missing) == (1, 1, 0)
    assert result.anomaly_counts == dict.fromkeys(result.anomaly_counts, 0)


HEADER_CASES: list[tuple[list[tuple[str, bytes]], int | None]] = [
    ([], None),
    ([("deliver-after", b"1500")], T0 + 1500),
    ([("deliver-after", b"250ms")], T0 + 250),
    ([("deliver-after", b"30s")], T0 + 30_000),
    ([("deliver-after", b"5m")], T0 + 300_000),
    ([("deliver-after", b"2h")], T0 + 7_200_000),
    ([("deliver-after", b"7d")], T0 + 7 * 86_400_000),
    ([("deliver-at", b"1700000001234")], 1_700_000_001_234),
    ([("deliver-at", b"2023-11-14T22:13:20Z")], 1_700_000_000_000),
    ([("deliver-at", b"2023-11-14T23:13:20.5+01:00")], 1_700_000_000_500),
    ([("deliver-after", b"-5s")], None),
    ([("deliver-after", b"tomorrow")], None),
    ([("deliver-at", b"1"), ("deliver-after", b"1")], None),
    ([("deliver-at", b"1"), ("deliver-at", b"2")], None),
    ([("deliver-after", b"999999999999999999d")], None),
    ([("deliver-at", b"999999999999999999")], None),
    ([("other", b"1s")], None),
]


def test_requested_deliver_at_follows_the_contract_forms(spark: SparkSession) -> None:
    df = frame(spark, [record("h", i, T0, headers) for i, (headers, _) in enumerate(HEADER_CASES)])
    got = {
        r["offset"]: r["requested_ms"]
        for r in with_requested_deliver_at(df.withColumn("publish_ms", F.unix_millis("timestamp"))).collect()
    }
    assert [(headers, got[i]) for i, (headers, _) in enumerate(HEADER_CASES)] == [
        (headers, expected) for headers, expected in HEADER_CASES
    ]


def test_cancels_and_reschedules_set_the_expected_fate(
    result: AuditResult, all_anomalies: list[dict[str, Any]]
) -> None:
    billing, shipping = summary(result, "cx", "billing"), summary(result, "cx", "shipping")
    assert (billing.cancelled, billing.rescheduled, billing.missing) == (3, 2, 0)
    assert (shipping.cancelled, shipping.rescheduled, shipping.missing) == (2, 1, 0)
    assert (billing.delivered_after_cancel, billing.rescheduled_early) == (1, 1)
    assert (shipping.delivered_after_cancel, shipping.rescheduled_early, shipping.early) == (0, 0, 0)
    kinds = sorted((a["kind"], a["offset"], a["subscription"]) for a in anomalies_of(all_anomalies, "cx"))
    assert kinds == [("delivered_after_cancel", 1, "billing"), ("rescheduled_early", 3, "billing")]
