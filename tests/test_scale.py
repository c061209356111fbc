"""Several sidecars in one group on the real broker: a planned leave hands partitions over at once.

The embedded broker never expires a member that goes away, and a static member never sends
LeaveGroup when it closes, so without --leave-group-on-stop the partitions of a stopped sidecar
are never delivered by anyone (issue 15). Each test counts deliveries per record.
"""

import time
import uuid
from pathlib import Path

import pytest

from sidecar.app import member_instance_id
from sidecar.broker.ports import free_port
from sidecar.errors import BrokerError
from sidecar.group_leave import leave_group
from sidecar.settings import RunSettings
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


def test_a_stop_with_leave_group_on_stop_hands_the_partitions_to_the_other_member(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, partitions, count = topic_factory("leave", partitions=4), 4, 4_000
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    group, ports = f"g-{topic}", (free_port(), free_port())
    a, b = (
        SidecarProcess(
            run_args(kafka, policies, tmp_path / name, port, group, "--leave-group-on-stop"), tmp_path / f"{name}.log"
        )
        for name, port in zip("ab", ports, strict=True)
    )

    def assigned(member: SidecarProcess) -> bool:
        return any(f"{topic}/" in line for line in member.log.read_text().splitlines() if "partitions assigned" in line)

    def tracked(port: int) -> float:
        return scrape(port, "delay_sidecar_tracked_messages", topic=topic)

    try:
        a.start()
        wait_for(lambda: assigned(a), 60, "a serving")
        b.start()
        # Both hold partitions before anything is produced: what b indexes, only b can deliver.
        wait_for(lambda: assigned(b) and "partitions revoked" in a.log.read_text(), 60, "a sharing with b")
        due = int(time.time() * 1000) + 15_000
        produce_due(kafka_helper, topic, [due + i % 2_000 for i in range(count)], partitions=partitions)
        wait_for(lambda: tracked(ports[0]) + tracked(ports[1]) == count, 60, "both members indexing")
        assert tracked(ports[1]) > 0, "b holds no partition: the test would prove nothing"
        handoffs = scrape(ports[0], "delay_sidecar_partition_handoffs_total", event="assigned")
        assert b.stop() == 0, b.tail()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", partitions) >= count, 90, "a delivering b's records")
        assert scrape(ports[0], "delay_sidecar_partition_handoffs_total", event="assigned") > handoffs
        delivered_by_a = scrape(ports[0], "delay_sidecar_messages_delivered_total", topic=topic, subscription="a")
        assert a.stop() == 0, a.tail()
    finally:
        a.close()
        b.close()
    assert delivered_by_a == count, "b delivered some records itself: its stop came after they fell due"
    assert "left the consumer group" in b.log.read_text()
    assert_once_each(kafka_helper, f"{topic}.a", count)


def test_leave_group_on_stop_has_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RunSettings().leave_group_on_stop is False
    monkeypatch.setenv("DELAY_SIDECAR_LEAVE_GROUP_ON_STOP", "true")
    assert RunSettings().leave_group_on_stop is True


def test_leave_group_on_stop_on_a_secured_cluster_joins_as_a_dynamic_member(tmp_path: Path) -> None:
    """The planned leave of a static member speaks PLAINTEXT (group_leave.py); elsewhere librdkafka's close leaves."""
    static = RunSettings(state_dir=tmp_path, leave_group_on_stop=True, instance_id="me")
    assert member_instance_id(static) == "me"
    secured = RunSettings(state_dir=tmp_path, leave_group_on_stop=True, security_protocol="SASL_SSL", instance_id="me")
    assert member_instance_id(secured) is None
    assert member_instance_id(RunSettings(state_dir=tmp_path, security_protocol="SASL_SSL", instance_id="me")) == "me"


def test_a_leave_that_reaches_no_broker_says_what_it_means_for_the_partitions() -> None:
    with pytest.raises(BrokerError, match=r"no answer in 1 s .*partitions stay with it until it comes back"):
        leave_group(f"127.0.0.1:{free_port()}", "g", "member-0", timeout_s=1.0)


def test_leaving_a_group_the_member_is_not_in_is_not_an_error(kafka: str) -> None:
    """UNKNOWN_MEMBER_ID: a member that already left (or never joined) has nothing to hand over."""
    leave_group(kafka, f"g-{uuid.uuid4().hex[:8]}", "never-joined")


def test_a_static_member_whose_place_another_took_stops_delivering(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """B starts with A's --instance-id (a second host given the same name, or A's replacement while A
    was frozen): the broker fences A's consumer. librdkafka hands that to `consume` as an error of
    code _FATAL whose fatal() is False, and A took it for a passing error: it went on delivering and
    committing beside B (found by the chaos test as 55 duplicated redeliveries in exactly-once mode,
    where B had not fenced A's producer because A had not committed with it yet). A's engine must
    stop instead, and say why."""
    topic = topic_factory("fenced")
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    group, ports, member = f"g-{topic}", (free_port(), free_port()), f"member-{uuid.uuid4().hex[:6]}"
    a, b = (
        SidecarProcess(
            run_args(kafka, policies, tmp_path / name, port, group, "--instance-id", member),
            tmp_path / f"{name}.log",
            env={"TMPDIR": str(tmp_path / f"host-{name}")},  # as if on hosts of their own (sidecar/identity.py)
        )
        for name, port in zip(("a", "b"), ports, strict=True)
    )
    for name in ("a", "b"):
        (tmp_path / f"host-{name}").mkdir()
    try:
        a.start()
        wait_for(lambda: "partitions assigned" in a.log.read_text(), 60, "A serving")
        b.start()
        wait_for(lambda: "partitions assigned" in b.log.read_text(), 60, "B taking A's place")
        wait_for(lambda: "engine failed" in a.log.read_text(), 60, "A's engine stopping")
    finally:
        a.close()  # before its next engine takes the place back from B
        b.close()
    failed = [line for line in a.log.read_text().splitlines() if "engine failed" in line]
    assert "the inbound consumer failed for good" in failed[0] and "group.instance.id" in failed[0], failed[0]
