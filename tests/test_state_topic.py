"""Handoffs through the state topic, on the real broker (issue 15).

A member that takes over a partition without usable local state loads its sealed buckets from the
state topic and reads only the unsealed tail of the log. Every test counts deliveries per record,
reading each outbound topic to its end, and measures what the new owner read from the log with
`messages_replayed_total`.

Records are all delayed and the mutable bucket seals every SEAL entries, so a partition's unsealed
tail is at most SEAL records: that is the bound on what a handoff may read again. A deleted state
topic, and a lost state dir after kill -9, are in tests/tracker/test_recovery_broker.py.
"""

import os
import time
from pathlib import Path

from sidecar.broker.ports import free_port
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    TopicFactory,
    assert_once_each,
    outbound_end,
    produce_due,
    run_args,
    scrape,
    wait_for,
)

SEAL = 500
PER_PARTITION = int(os.environ.get("STATE_TOPIC_TEST_PER_PARTITION", "2000"))
"""Pending records per partition in the three-member test. The issue's size, 500,000 pending in all,
is STATE_TOPIC_TEST_PER_PARTITION=41667 (a few minutes; docs/scaling.md has that run)."""


def _member(
    kafka: str, policies: Path, tmp_path: Path, name: str, group: str, *extra: str
) -> tuple[SidecarProcess, int]:
    port = free_port()
    args = run_args(kafka, policies, tmp_path / name, port, group, "--leave-group-on-stop",
                    "--bucket-min-index-count", str(SEAL), "--instance-id", f"{group}-{name}", *extra)  # fmt: skip
    return SidecarProcess(args, tmp_path / f"{name}.log"), port


def _owned(member: SidecarProcess, topic: str) -> set[int]:
    """The partitions of `topic` the member's last assignment gave it (from its log)."""
    owned: set[int] = set()
    for line in member.log.read_text().splitlines():
        if "partitions assigned" in line:
            owned = {int(p.rsplit("/", 1)[1]) for p in line.split("partitions=")[1].split(",") if p.startswith(topic)}
    return owned


def _tracked(port: int, topic: str) -> float:
    return scrape(port, "delay_sidecar_tracked_messages", topic=topic)


def test_three_members_hand_a_leaving_members_partitions_over_from_the_state_topic(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    partitions, per_partition = 12, PER_PARTITION
    topic, count = topic_factory("handoff", partitions=partitions), partitions * per_partition
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    group = f"g-{topic}"
    members = [_member(kafka, policies, tmp_path, name, group, "--processing-guarantee", "exactly-once")
               for name in "abc"]  # fmt: skip
    (a, a_port), (b, b_port), (c, c_port) = members
    try:
        for member, _ in members:
            member.start()
            wait_for(lambda m=member: bool(_owned(m, topic)), 60, "the member serving")  # type: ignore[misc]
        wait_for(lambda: sum(len(_owned(m, topic)) for m, _ in members) == partitions, 60, "the group settled")
        before = {p: name for name, (m, _) in zip("abc", members, strict=True) for p in _owned(m, topic)}
        assert "c" in before.values(), "c holds no partition: the test would prove nothing"
        # Nothing falls due before the handoff, at any size.
        due = int(time.time() * 1000) + 18_000 + max(count - 24_000, 0) // 10
        produce_due(kafka_helper, topic, [due + i % 5_000 for i in range(count)], partitions=partitions)
        ports = (a_port, b_port, c_port)
        wait_for(lambda: sum(_tracked(p, topic) for p in ports) == count, 90 + count // 1_000, "every record indexed")
        wait_for(lambda: scrape(c_port, "delay_sidecar_state_records_total") > 0, 30, "c's snapshots written")
        replayed_before = sum(scrape(p, "delay_sidecar_messages_replayed_total", topic=topic) for p in (a_port, b_port))
        assert c.stop() == 0, c.tail()
        wait_for(lambda: len(_owned(a, topic) | _owned(b, topic)) == partitions, 60, "c's partitions moved")
        after = {p: name for name, (m, _) in zip("ab", members, strict=False) for p in _owned(m, topic)}
        moved = [p for p in range(partitions) if before[p] != after[p]]  # c's, and a round-robin reshuffle
        restored = sum(scrape(p, "delay_sidecar_state_restores_total", result="state-topic") for p in (a_port, b_port))
        replayed = sum(scrape(p, "delay_sidecar_messages_replayed_total", topic=topic) for p in (a_port, b_port))
        wait_for(
            lambda: outbound_end(kafka_helper, f"{topic}.a") >= count, 120 + count // 1_000, "every record delivered"
        )
        for member, _ in members[:2]:
            assert member.stop() == 0, member.tail()
    finally:
        for member, _ in members:
            member.close()
    assert restored >= len(moved), "the new owners did not load the moved partitions from the state topic"
    # Each moved partition read at most its unsealed tail again, not all its pending records.
    assert replayed - replayed_before <= len(moved) * SEAL, (replayed, replayed_before, moved)
    print(f"pending {count}, moved partitions {len(moved)} ({len(moved) * per_partition} pending), "
          f"read again from the log {replayed - replayed_before}")  # fmt: skip
    assert_once_each(kafka_helper, f"{topic}.a", count)


def test_a_partition_that_comes_back_after_another_owner_does_not_use_its_stale_local_state(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """A owns everything, B takes half and indexes more, B leaves: A's index of B's half is stale."""
    partitions, batch = 4, 4_000
    topic = topic_factory("aba", partitions=partitions)
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    group = f"g-{topic}"
    (a, a_port), (b, b_port) = (_member(kafka, policies, tmp_path, name, group) for name in "ab")
    try:
        a.start()
        wait_for(lambda: len(_owned(a, topic)) == partitions, 60, "a serving alone")
        due = int(time.time() * 1000) + 20_000  # after a's start: the lead covers b's start and both intakes
        produce_due(kafka_helper, topic, [due + i % 2_000 for i in range(batch)], partitions=partitions)
        wait_for(lambda: _tracked(a_port, topic) == batch, 60, "a indexing the first batch")
        wait_for(lambda: scrape(a_port, "delay_sidecar_state_records_total") > 0, 30, "a's snapshots written")
        b.start()
        wait_for(lambda: bool(_owned(b, topic)) and len(_owned(a, topic)) < partitions, 60, "a sharing with b")
        away = _owned(b, topic)
        produce_due(kafka_helper, topic, [due + i % 2_000 for i in range(batch)], partitions=partitions)
        wait_for(lambda: _tracked(a_port, topic) + _tracked(b_port, topic) == 2 * batch, 60, "the second batch indexed")
        wait_for(lambda: scrape(b_port, "delay_sidecar_state_restores_total", result="state-topic") >= len(away), 10,
                 "b loading its share from a's snapshots")  # fmt: skip
        # b's first writes: what it loaded was already there, and the second batch sealed new buckets.
        wait_for(lambda: scrape(b_port, "delay_sidecar_state_records_total") > 0, 30, "b's snapshots written")
        assert b.stop() == 0, b.tail()
        wait_for(lambda: len(_owned(a, topic)) == partitions, 60, "b's partitions back at a")
        restored = scrape(a_port, "delay_sidecar_state_restores_total", result="state-topic")
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= 2 * batch, 120, "every record delivered")
        assert a.stop() == 0, a.tail()
    finally:
        a.close()
        b.close()
    stale = [line for line in a.log.read_text().splitlines() if "local index is stale" in line]
    assert {int(line.split("partition=")[1].split()[0].rsplit("/", 1)[1]) for line in stale} >= away
    assert restored >= len(away), "a did not load b's snapshots"
    assert_once_each(kafka_helper, f"{topic}.a", 2 * batch)
