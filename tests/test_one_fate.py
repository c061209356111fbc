"""One record, one fate, across members with state dirs of their own, restarts and policy changes.

Each pod of a StatefulSet keeps its volume: a member that comes back after another one served its
partitions finds a local index the group has moved past. The index it left may agree with the
group's cursor and delivered watermark and still be wrong: another member dead-lettered the
records of a removed topic, which moves only the commit's earliest pending offset. Counted per
record, each topic read to its high watermark.
"""

import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

from sidecar.broker.ports import free_ports
from sidecar.client import Nacker
from sidecar.client_cancel import Canceller, OutcomeReader
from sidecar.outbound.records import DELIVER_AT, ERROR_CODE, ORIGIN_OFFSET, ORIGIN_PARTITION
from sidecar.partitions.metadata import CommitMetadata
from tests.kafka_helpers import (
    KafkaHelper,
    Received,
    SidecarProcess,
    accepted_lines,
    committed,
    deliveries,
    early,
    outbound_end,
    run_args,
    scrape,
    wait_for,
    wait_serving,
)
from tests.test_topic_removal import nothing_pending, policy

DEADLINE_S = 90.0
PARTITIONS = 2
PENDING = 50
"""Records per partition pending when the first member stops."""
DUE_IN_MS = 25_000
"""Their delay: past the first member's stop, and soon enough for the test to see them fall due."""


def origins(records: list[Received]) -> Counter[tuple[int, int]]:
    return Counter((int(r.headers[ORIGIN_PARTITION]), int(r.headers[ORIGIN_OFFSET])) for r in records)


def produce_at(kafka_helper: KafkaHelper, topic: str, deliver_at: int, count: int) -> None:
    for partition in range(PARTITIONS):
        for i in range(count):
            headers = [("deliver-at", str(deliver_at))]
            kafka_helper.produce(topic, f"{partition}-{i}".encode(), headers=headers, partition=partition)
    kafka_helper.flush()


def serving(member: SidecarProcess, port: int, workers: str) -> None:
    """Started, and owning partitions: with --workers, every worker (on the ports after `port`), so
    that no worker's join rebalances the group while a test's records are delivered. On noida-db a
    join made the first worker lose its partitions before its revoke could commit what it had
    delivered, and the next owner delivered 200 records again (a clean-clone run, 2026-11-30)."""
    member.start()
    for worker_port in [port] if workers == "1" else [port + 1 + i for i in range(int(workers))]:
        wait_serving(worker_port, 150.0)


@pytest.mark.parametrize(
    ("guarantee", "workers", "back"),
    [("at-least-once", "1", False), ("exactly-once", "2", False), ("at-least-once", "1", True)],
    ids=["at-least-once", "exactly-once-2-workers", "removed-and-added-back-while-A-was-down"],
)
def test_a_member_back_on_its_old_state_dir_does_not_revive_what_another_member_dead_lettered(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    tmp_path: Path,
    guarantee: str,
    workers: str,
    back: bool,
) -> None:
    """A serves T and stops with records pending; B, with a state dir of its own and T removed from
    its policy, dead-letters them; A comes back on its old state dir with T in its policy. The
    records were dead-lettered once, and A delivers none of them (issue 48: it delivered all).
    `back`: T returns to B's policy after the drain, and B delivers a record of its own before it
    stops; A does not deliver that one again either."""
    topic, other = topic_factory("t", partitions=PARTITIONS), topic_factory("other", partitions=PARTITIONS)
    with_topic, without = tmp_path / "a.yaml", tmp_path / "b.yaml"
    with_topic.write_text(policy(topic, other))
    without.write_text(policy(other))
    group = f"g-{topic}"
    base = free_ports(6)  # each member: its metrics port, then one per worker
    ports = (base, base + 3)
    extra = ("--processing-guarantee", guarantee, "--workers", workers)
    a = SidecarProcess(run_args(kafka, with_topic, tmp_path / "a", ports[0], group, *extra), tmp_path / "a.log")
    b = SidecarProcess(run_args(kafka, without, tmp_path / "b", ports[1], group, *extra), tmp_path / "b.log")
    exact = guarantee == "exactly-once"
    try:
        serving(a, ports[0], workers)
        due = int(time.time() * 1000) + DUE_IN_MS
        produce_at(kafka_helper, topic, due, PENDING)
        wait_for(
            lambda: [o for o, _ in committed(kafka, group, topic, PARTITIONS)] == [PENDING] * PARTITIONS,
            DEADLINE_S,
            "A's commit of every record",
        )
        assert a.stop() == 0, a.tail()
        assert time.time() * 1000 < due, "the test's records fell due before A stopped: raise DUE_IN_MS"
        b.start()
        wait_for(lambda: nothing_pending(kafka, group, topic, PARTITIONS), DEADLINE_S, "B's drain, committed")
        if back:
            without.write_text(policy(topic, other))  # B serves T again, from its commit
            port = ports[1] if workers == "1" else ports[1] + 1
            wait_for(lambda: scrape(port, "delay_sidecar_policy_generation") >= 2, DEADLINE_S, "B's reload")
            produce_at(kafka_helper, topic, int(time.time() * 1000) + 1_000, 1)
            wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", PARTITIONS) >= PARTITIONS, DEADLINE_S, "B's own")
        assert b.stop() == 0, b.tail()
        serving(a, ports[0], workers)
        # A marker on each partition falls due after the pending records: once A has delivered the
        # markers, it has passed the pending records' due time.
        produce_at(kafka_helper, topic, max(due, int(time.time() * 1000)) + 1_000, 1)
        owed = PARTITIONS * (2 if back else 1)
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", PARTITIONS) >= owed, DEADLINE_S, "markers")
        assert a.stop() == 0, a.tail()
    finally:
        a.close()
        b.close()
    dead = kafka_helper.read_to_end(f"{topic}.dlt", committed_only=exact)
    pending = {(p, o) for p in range(PARTITIONS) for o in range(PENDING)}
    assert origins(dead) == Counter(pending), b.tail()
    assert {r.headers[ERROR_CODE] for r in dead} == {b"TOPIC_REMOVED"}
    delivered = kafka_helper.read_to_end(f"{topic}.a", committed_only=exact)
    revived = sorted(set(origins(delivered)) & pending)
    assert not revived, f"{len(revived)} dead-lettered records delivered too, e.g. {revived[:5]}\n{a.tail()}"
    after = range(PENDING, PENDING + (2 if back else 1))  # B's own records if any, then the markers
    assert origins(delivered) == Counter({(p, o) for p in range(PARTITIONS) for o in after})  # once each


@pytest.mark.parametrize(
    ("fault", "workers"),
    [
        pytest.param("SIGTERM", "1", marks=pytest.mark.fallback),
        pytest.param("kill -9", "1", marks=pytest.mark.fallback),
        # Not on noida-db: its group never expires the stopped workers' static members, and answers
        # the second worker's return, 60 s after the first's, with overlapping assignments (both
        # workers delivered one partition's 200 records: 3 runs of 3 with the forced rebalance left
        # out) or, when both force one, with no assignment for 90 s and more (docs/guides/operators/
        # deployment.md). Kept on Apache Kafka, which expires and fences.
        ("kill -9", "2"),
    ],
)
def test_a_topic_added_across_a_restart_is_served(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    tmp_path: Path,
    fault: str,
    workers: str,
) -> None:
    """The sidecar serves one topic and stops; a second topic joins the policy file, as a rollout
    with a new ConfigMap does, and the sidecar starts again on its state dir within the session
    timeout. As a static member it got the group's stored assignment, without the new topic's
    partitions: none of 400 records reached the new topic's subscription (issue 48)."""
    first, added = topic_factory("first", partitions=PARTITIONS), topic_factory("added", partitions=PARTITIONS)
    path = tmp_path / "policies.yaml"
    path.write_text(policy(first))
    group, port = f"g-{first}", free_ports(3)
    args = run_args(kafka, path, tmp_path / "state", port, group, "--workers", workers)
    member = SidecarProcess(args, tmp_path / "log")
    try:
        serving(member, port, workers)
        if fault == "kill -9":
            member.kill()
        else:
            assert member.stop() == 0, member.tail()
        path.write_text(policy(first, added))
        serving(member, port, workers)
        for i in range(400):
            kafka_helper.produce(added, f"{i}".encode(), partition=i % PARTITIONS)
        kafka_helper.flush()
        wait_for(lambda: outbound_end(kafka_helper, f"{added}.a", PARTITIONS) >= 400, DEADLINE_S, "the added topic")
        assert member.stop() == 0, member.tail()
    finally:
        member.close()
    assert sorted(Counter(r.value for r in kafka_helper.read_to_end(f"{added}.a")).values()) == [1] * 400


def test_a_member_back_after_a_drain_killed_midway_delivers_only_what_was_not_dead_lettered(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """As above, but B is killed part-way through its drain and writes no manifest: A's own manifest
    in the state topic, written before B's drain, still holds records that B's commit says were
    dead-lettered, above the committed watermark. A must take that commit's word over its manifest."""
    topic, other = topic_factory("t"), topic_factory("other")
    with_topic, without = tmp_path / "a.yaml", tmp_path / "b.yaml"
    with_topic.write_text(policy(topic, other))
    without.write_text(policy(other))
    group, base = f"g-{topic}", free_ports(2)
    a = SidecarProcess(run_args(kafka, with_topic, tmp_path / "a", base, group), tmp_path / "a.log")
    b_args = run_args(kafka, without, tmp_path / "b", base + 1, group, "--state-topic", "none")
    b = SidecarProcess(b_args, tmp_path / "b.log")
    count = 100_000  # sealed into buckets, so A's manifest holds them; and a drain long enough to kill
    try:
        serving(a, base, "1")
        due = int(time.time() * 1000) + 40_000
        for i in range(count):
            kafka_helper.produce(topic, f"{i}".encode(), headers=[("deliver-at", str(due))])
        kafka_helper.flush()
        wait_for(lambda: committed(kafka, group, topic, 1)[0][0] == count, DEADLINE_S, "A's commit of every record")
        assert a.stop() == 0, a.tail()
        b.start()

        def drained_to() -> int:
            return CommitMetadata.decode(committed(kafka, group, topic, 1)[0][1]).earliest or 0

        wait_for(lambda: drained_to() > 0, DEADLINE_S, "B's drain committed part-way")
        b.kill()
        drained = drained_to()
        assert 0 < drained < count, f"B's drain committed {drained}: not part-way"
        serving(a, base, "1")
        marker_at = max(due, int(time.time() * 1000)) + 1_000  # due after every record of the test
        kafka_helper.produce(topic, b"marker", headers=[("deliver-at", str(marker_at))], partition=0)
        kafka_helper.flush()
        owed = count - drained + 1  # what B's commit left pending, then the marker, due last
        wait_for(lambda: kafka_helper.end_offsets(f"{topic}.a")[0] >= owed, 2 * DEADLINE_S, "A's deliveries")
        assert a.stop() == 0, a.tail()
    finally:
        a.close()
        b.close()
    dead = set(origins(kafka_helper.read_to_end(f"{topic}.dlt")))
    delivered = origins(kafka_helper.read_to_end(f"{topic}.a"))
    revived = sorted(o for _, o in delivered if o < drained)
    delivered.pop((0, count))  # the marker
    assert not revived, f"{len(revived)} records B's commit says were dead-lettered delivered too, e.g. {revived[:5]}"
    # Above B's commit, B's uncommitted dead letters may repeat as deliveries (at least once, a takeover).
    assert {(0, o) for o in range(count)} <= dead | set(delivered), "a record with no fate"
    assert all(n == 1 for n in delivered.values()), "a record delivered twice"


def test_a_member_back_after_another_delivered_cancelled_rescheduled_and_nacked_repeats_none_of_it(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """At least once, the looser mode: A indexes 40 records and stops; B, with a state dir of its own,
    delivers ten of them, cancels ten, reschedules ten and nacks five of those it delivered, then
    stops cleanly; A comes back on its old state dir. Each record's fate is B's: nothing cancelled
    goes out, nothing rescheduled goes out before its new time, each nack comes back once, and
    nothing B delivered goes out again."""
    topic, control = topic_factory("t"), f"ctl-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "policies.yaml"
    path.write_text(policy(topic))
    group, base = f"g-{topic}", free_ports(2)
    extra = ("--control-topic", control)
    a = SidecarProcess(run_args(kafka, path, tmp_path / "a", base, group, *extra), tmp_path / "a.log")
    b = SidecarProcess(run_args(kafka, path, tmp_path / "b", base + 1, group, *extra), tmp_path / "b.log")
    producer = Producer({"bootstrap.servers": kafka})
    try:
        serving(a, base, "1")
        soon, later = int(time.time() * 1000) + 15_000, int(time.time() * 1000) + 45_000
        for i in range(40):
            at = soon if i < 10 else later
            kafka_helper.produce(topic, f"{i}".encode(), headers=[("deliver-at", str(at))], partition=0)
        kafka_helper.flush()
        wait_for(lambda: committed(kafka, group, topic, 1)[0][0] == 40, DEADLINE_S, "A's commit of every record")
        assert a.stop() == 0, a.tail()
        serving(b, base + 1, "1")
        moved = later + 5_000
        with OutcomeReader({"bootstrap.servers": kafka}, control) as reader:
            canceller = Canceller(producer, control)
            ids = [canceller.cancel(f"{topic}/0/{o}") for o in range(10, 20)]
            ids += [canceller.reschedule_at(f"{topic}/0/{o}", moved) for o in range(20, 30)]
            canceller.flush(10)
            answers = reader.wait(ids, timeout_s=DEADLINE_S)
        assert [answers[i].outcome for i in ids] == ["cancelled"] * 10 + ["rescheduled"] * 10
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= 10, DEADLINE_S, "B's deliveries")
        nacker = Nacker(producer, control, "a")
        for record in kafka_helper.read_to_end(f"{topic}.a")[:5]:
            nacker.nack_at(Message(record.headers), moved)
        nacker.flush(10)
        wait_for(lambda: accepted_lines(kafka_helper, control) >= 5, DEADLINE_S, "B's acceptance of the nacks")
        assert b.stop() == 0, b.tail()
        serving(a, base, "1")
        kafka_helper.produce(topic, b"marker", headers=[("deliver-at", str(moved + 1_000))], partition=0)
        kafka_helper.flush()
        wait_for(
            lambda: any(r.value == b"marker" for r in kafka_helper.read_to_end(f"{topic}.a")), DEADLINE_S, "marker"
        )
        assert a.stop() == 0, a.tail()
    finally:
        a.close()
        b.close()
    records = [r for r in kafka_helper.read_to_end(f"{topic}.a") if r.value != b"marker"]
    expected = Counter({(0, o, 0): 1 for o in [*range(10), *range(20, 40)]} | {(0, o, 1): 1 for o in range(5)})
    assert deliveries(records) == expected, a.tail()
    assert not early(records)
    assert all(int(r.headers[DELIVER_AT]) >= moved for r in records if 20 <= int(r.headers[ORIGIN_OFFSET]) < 30)


class Message:
    """An outbound record as the Nacker reads it: only its headers."""

    def __init__(self, headers: dict[str, bytes]) -> None:
        self._headers = list(headers.items())

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers
