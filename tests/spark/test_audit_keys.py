"""The audit's reading of keyed topics (`by_key: replace`) against the sidecar's own rule.

The oracle is the sidecar's key step (sidecar.policy.by_key), fed the same log in offset order:
what it says was replaced, the audit must say was replaced, from the log alone and through other
code. Timestamps jitter and now and then run ahead by more than a delay (a producer whose clock is
fast), and the blocks of offsets are made small so that they chain.
"""

import random

import pytest
from pyspark.sql import SparkSession

from sidecar.control.cancels import COMMAND_BY
from sidecar.policy.by_key import KeyStep
from sidecar.tracker.keys import MemoryKeys
from spark import keys as spark_keys
from spark.audit import run_audit
from spark.model import AuditInputs, AuditParams, AuditResult, AuditRoute
from tests.spark.records import Row, anomaly_rows, dead_lettered, delivered, frame, record

T0 = 1_700_000_000_000
AS_OF = T0 + 3_600_000
OWN = [(COMMAND_BY, b"the-group"), ("delay-clock", b"")]


class Log:
    """One keyed partition's records and what the sidecar's rule makes of them."""

    def __init__(self, seed: int, n: int) -> None:
        rng = random.Random(seed)
        self.rows: list[tuple[int, bytes | None, bytes | None, list[tuple[str, bytes]] | None]] = []
        self.dead: set[int] = set()
        self.own: set[int] = set()
        step = KeyStep(MemoryKeys())
        self.replaced: dict[int, int] = {}
        self.tombstones: set[int] = set()
        self.due: dict[int, int] = {}
        for offset in range(n):
            ts = T0 + offset * 20 + rng.randint(-300, 300)
            if rng.random() < 0.005:
                ts += 2_000  # a producer's clock ahead by more than most delays
            if rng.random() < 0.05:
                self.own.add(offset)
                self.rows.append((ts, None, None, OWN))
                step.note(offset, ts)
                continue
            key = rng.choice([None, b"", *(b"k%d" % i for i in range(12))])
            value = None if rng.random() < 0.1 else b"v"
            delay = rng.choice([None, 0, 200, 500, 1_000, 3_000])
            headers = None if delay is None else [("deliver-after", str(delay).encode())]
            deliver_at = ts + delay if delay else None
            self.rows.append((ts, key, value, headers))
            if rng.random() < 0.03:  # dead-lettered (by a policy the audit does not know): replaces nothing
                self.dead.add(offset)
                step.take(offset, ts, None, False, None)
                continue
            verdict = step.take(offset, ts, key, value is None, deliver_at)
            if verdict.replaced is not None:
                self.replaced[verdict.replaced] = offset
            if key and value is None:
                self.tombstones.add(offset)
            self.due[offset] = deliver_at or ts

    def inbound(self, topic: str) -> list[Row]:
        return [
            record(topic, offset, ts, headers, key=key, value=value)
            for offset, (ts, key, value, headers) in enumerate(self.rows)
        ]

    def messages(self) -> list[int]:
        return [offset for offset in range(len(self.rows)) if offset not in self.own and offset not in self.dead]


def audit(
    spark: SparkSession, inbound: list[Row], outbound: list[Row], dead: list[Row], routes: list[AuditRoute]
) -> AuditResult:
    inputs = AuditInputs(frame(spark, inbound), frame(spark, outbound), frame(spark, dead))
    return run_audit(spark, inputs, routes, AuditParams(as_of_ms=AS_OF, grace_ms=5_000))


def route(topic: str, sub: str = "billing", ordered: bool = False, keyed: bool = True) -> AuditRoute:
    return AuditRoute(topic, sub, f"{topic}.{sub}", f"{topic}.dlt", ordered=ordered, keyed=keyed)


AFTER = [("deliver-after", b"1000")]
EDGES: dict[str, tuple[list[tuple[int, bytes | None, list[tuple[str, bytes]] | None]], set[int]]] = {
    # topic: the records (timestamp, key, headers), nothing delivered; the offsets replaced
    "edge": ([(T0, b"a", AFTER), (T0 + 1_000, b"b", None), (T0 + 10, b"a", None)], set()),
    "below": ([(T0, b"a", AFTER), (T0 + 999, b"b", None), (T0 + 10, b"a", None)], {0}),
    "own": ([(T0, b"a", AFTER), (T0 + 1_000, None, OWN), (T0 + 10, b"a", None)], set()),
    # The log's clock is past a1's time before a1 is read: a1 is due at once, and a2 replaces nothing.
    "skew": ([(T0 + 5_000, b"z", None), (T0, b"a", AFTER), (T0 + 10, b"a", None)], set()),
    "skew-edge": (
        [(T0 + 5_000, b"z", None), (T0, b"a", AFTER), (T0 + 1_000, b"b", None), (T0 + 10, b"a", None)],
        set(),
    ),
    "undelayed": ([(T0, b"a", None), (T0 + 10, b"a", AFTER)], set()),
}


@pytest.fixture(scope="module")
def logs() -> list[Log]:
    return [Log(seed, 600) for seed in range(3)]


@pytest.fixture(scope="module")
def result(spark: SparkSession, logs: list[Log]) -> AuditResult:
    """Per log, three topics: `all-N` gets every message delivered (the replaced ones and the
    tombstones must show as anomalies), `owed-N` only what the rule owes (a clean audit), and
    `plain-N`, not keyed, the same as `all-N` (nothing is replaced there). Then the EDGES, with
    nothing delivered."""
    inbound: list[Row] = []
    outbound: list[Row] = []
    dead: list[Row] = []
    routes: list[AuditRoute] = []
    for n, log in enumerate(logs):
        for name, keyed in ((f"all-{n}", True), (f"owed-{n}", True), (f"plain-{n}", False)):
            routes += [route(name, keyed=keyed), route(name, "audit-trail", ordered=True, keyed=keyed)]
            inbound += log.inbound(name)
            dead += [
                dead_lettered(f"{name}.dlt", i, T0, (name, 0, o), "MAX_DELAY_EXCEEDED")
                for i, o in enumerate(sorted(log.dead))
            ]
            out = 0
            for offset in log.messages():
                ts = log.rows[offset][0]
                outbound.append(delivered(f"{name}.audit-trail", offset, ts + 1, (name, 0, offset), ts))
                owed = offset not in log.replaced and offset not in log.tombstones
                if owed or not name.startswith("owed"):
                    due = log.due[offset]
                    outbound.append(delivered(f"{name}.billing", out, max(due, ts) + 1, (name, 0, offset), due))
                    out += 1
    for topic, (rows, _) in EDGES.items():
        routes.append(route(topic))
        inbound += [record(topic, offset, ts, headers, key=key) for offset, (ts, key, headers) in enumerate(rows)]
    # A keyed topic removed with a1 and a2 pending: its drain dead-lettered a2 only (a2 replaced a1).
    routes.append(route("removed"))
    inbound += [record("removed", 0, T0, AFTER, key=b"a"), record("removed", 1, T0 + 10, AFTER, key=b"a")]
    dead.append(dead_lettered("removed.dlt", 0, T0 + 20, ("removed", 0, 1), "TOPIC_REMOVED"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spark_keys, "BLOCK", 97)  # several blocks per partition, chained
        return audit(spark, inbound, outbound, dead, routes)


def test_the_rule_takes_both_ways_in_the_generated_logs(logs: list[Log]) -> None:
    assert all(len(log.replaced) > 20 and len(log.tombstones) > 5 for log in logs)


def test_the_audit_finds_what_the_sidecars_rule_replaced(logs: list[Log], result: AuditResult) -> None:
    found = {(a["topic"], a["offset"], a["detail"]) for a in anomaly_rows(result) if a["kind"] != "missing"}
    expected = set()
    for n, log in enumerate(logs):
        expected |= {(f"all-{n}", p, f"replaced by offset {o} of its key") for p, o in log.replaced.items()}
        expected |= {(f"all-{n}", t, "a tombstone of a keyed topic, delivered") for t in log.tombstones}
    assert found == expected
    assert result.anomaly_counts["delivered_replaced"] == len(expected)


def test_what_the_rule_owes_audits_clean_and_counts_the_replaced(logs: list[Log], result: AuditResult) -> None:
    by_route = {(s.topic, s.subscription): s for s in result.subscriptions}
    for n, log in enumerate(logs):
        owed = by_route[(f"owed-{n}", "billing")]
        replaced_only = set(log.replaced) - log.tombstones
        assert (owed.replaced, owed.tombstones) == (len(replaced_only), len(log.tombstones))
        assert (owed.missing, owed.delivered, owed.delivered_replaced) == (
            0,
            len(log.messages()) - len(replaced_only | log.tombstones),
            0,
        )
        for name in (f"all-{n}", f"owed-{n}", f"plain-{n}"):
            trail = by_route[(name, "audit-trail")]  # ordered: keys change nothing
            assert (trail.replaced, trail.tombstones, trail.delivered) == (0, 0, len(log.messages()))
        plain = by_route[(f"plain-{n}", "billing")]
        assert (plain.replaced, plain.tombstones, plain.delivered) == (0, 0, len(log.messages()))


def test_a_record_stamped_exactly_at_the_deliver_at_in_between_means_the_older_was_due(result: AuditResult) -> None:
    by_topic = {s.topic: s.replaced for s in result.subscriptions if s.topic in EDGES}
    assert by_topic == {topic: len(replaced) for topic, (_, replaced) in EDGES.items()}
    missing = {(a["topic"], a["offset"]) for a in anomaly_rows(result) if a["kind"] == "missing"}
    owed = {
        (topic, offset)
        for topic, (rows, replaced) in EDGES.items()
        for offset, row in enumerate(rows)
        if row[2] is not OWN and offset not in replaced
    }
    assert missing == owed  # nothing was delivered: exactly the owed records are missing


def test_a_record_dead_lettered_when_its_topic_left_the_policies_still_replaced_the_older(
    result: AuditResult,
) -> None:
    """A dead letter of intake replaces nothing, but one of a removed topic's drain came after the key
    rule had decided: the record it took had replaced its key's older one, which stays replaced."""
    (removed,) = [s for s in result.subscriptions if s.topic == "removed"]
    assert (removed.replaced, removed.rejected, removed.missing) == (1, 1, 0)
