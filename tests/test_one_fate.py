"""One record, one fate, across members with state dirs of their own, restarts and policy changes.

Each pod of a StatefulSet keeps its volume: a member that comes back after another one served its
partitions finds a local index the group has moved past. The index it left may agree with the
group's cursor and delivered watermark and still be wrong: another member dead-lettered the
records of a removed topic, which moves only the commit's earliest pending offset. Counted per
record, each topic read to its high watermark.
"""

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.broker.ports import free_ports
from sidecar.outbound.records import ERROR_CODE, ORIGIN_OFFSET, ORIGIN_PARTITION
from tests.kafka_helpers import (
    KafkaHelper,
    Received,
    SidecarProcess,
    committed,
    outbound_end,
    run_args,
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
    """Started, and owning partitions (with --workers, its first worker, on the next port)."""
    member.start()
    wait_serving(port if workers == "1" else port + 1)


@pytest.mark.parametrize(
    ("guarantee", "workers"), [("at-least-once", "1"), ("exactly-once", "1"), ("exactly-once", "2")]
)
def test_a_member_back_on_its_old_state_dir_does_not_revive_what_another_member_dead_lettered(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    tmp_path: Path,
    guarantee: str,
    workers: str,
) -> None:
    """A serves T and stops with records pending; B, with a state dir of its own and T removed from
    its policy, dead-letters them; A comes back on its old state dir with T in its policy. The
    records were dead-lettered once, and A delivers none of them (issue 48: it delivered all)."""
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
        assert b.stop() == 0, b.tail()
        serving(a, ports[0], workers)
        # A marker on each partition falls due after the pending records: once A has delivered the
        # markers, it has passed the pending records' due time.
        produce_at(kafka_helper, topic, max(due, int(time.time() * 1000)) + 1_000, 1)
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", PARTITIONS) >= PARTITIONS, DEADLINE_S, "markers")
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
    assert origins(delivered) == Counter({(p, PENDING) for p in range(PARTITIONS)})  # the markers, once each


@pytest.mark.fallback
@pytest.mark.parametrize(("fault", "workers"), [("SIGTERM", "1"), ("kill -9", "1"), ("kill -9", "2")])
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
