"""Where is my message: GET /messages/{topic}/{partition}/{offset} and `messages show`, against the broker."""

import json
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from sidecar.broker.ports import free_port
from sidecar.outbound.records import ORIGIN
from sidecar.partitions.owner import find_owner
from tests.control.test_cancel import command, outcomes, policies
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    TopicFactory,
    run_args,
    scrape,
    start_serving,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]


def lookup(port: int, message_id: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/messages/{message_id}", timeout=20) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


def test_the_owner_says_where_each_message_is(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, control = topic_factory("lookup"), f"ctl-{uuid.uuid4().hex[:8]}"
    port, group = free_port(), f"g-{topic}"
    args = run_args(kafka, policies(topic, policy_file), tmp_path / "state", port, group, "--control-topic", control)
    sidecar = SidecarProcess(args, tmp_path / "log")
    later = int(time.time() * 1000) + 600_000
    kafka_helper.produce(topic, b"pending", headers=[("deliver-at", str(later))])  # 0
    kafka_helper.produce(topic, b"now")  # 1
    kafka_helper.produce(topic, b"bad", headers=[("deliver-after", "soon")])  # 2
    kafka_helper.produce(topic, b"to cancel", headers=[("deliver-at", str(later))])  # 3
    kafka_helper.produce(topic, b"to move", headers=[("deliver-at", str(later))])  # 4
    kafka_helper.flush()
    try:
        sidecar.start()
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 3, 60, "indexed")
        wait_for(lambda: scrape(port, "delay_sidecar_pending_due", topic=topic, within="all") == 3, 30, "the due gauge")
        assert scrape(port, "delay_sidecar_pending_due", topic=topic, within="1h") == 3
        assert scrape(port, "delay_sidecar_pending_due", topic=topic, within="1m") == 0
        producer = Producer({"bootstrap.servers": kafka})
        base = {"topic": topic, "partition": 0}
        command(producer, control, {**base, "type": "cancel", "offset": 3, "subscription": "fraud", "id": "c"})
        command(producer, control, {**base, "type": "reschedule", "offset": 4, "delay_ms": 60_000, "id": "r"})
        producer.flush(10)
        wait_for(lambda: len(outcomes(kafka_helper, control)) == 2, 30, "both answered")

        pending = lookup(port, f"{topic}/0/0")
        assert pending["state"] == "mixed", "pending for the delayed subscriptions, delivered to the exclusive one"
        assert pending["subscriptions"]["billing"] == {"state": "pending", "deliver_at": later}
        assert pending["subscriptions"]["audit"]["state"] == "delivered", "exclusive: at once"
        assert lookup(port, f"{topic}/0/1")["state"] == "delivered"
        nack_at = int(time.time() * 1000) + 600_000
        command(producer, control, {**base, "type": "nack", "subscription": "billing", "offset": 1,
                                    "deliver_at": nack_at})  # fmt: skip
        producer.flush(10)
        nacked = lambda: lookup(port, f"{topic}/0/1")["subscriptions"]  # noqa: E731
        wait_for(lambda: nacked()["billing"]["state"] == "pending", 30, "the nack pending")
        assert nacked()["billing"] == {"state": "pending", "deliver_at": nack_at, "nack": True, "redelivery_count": 1}
        assert nacked()["fraud"]["state"] == "delivered"
        bad = lookup(port, f"{topic}/0/2")
        assert (bad["state"], bad["code"]) == ("dead-lettered", "INVALID_DELAY_HEADER")
        cancelled = lookup(port, f"{topic}/0/3")["subscriptions"]
        assert cancelled["fraud"] == {"state": "cancelled"} and cancelled["billing"]["state"] == "pending"
        moved = lookup(port, f"{topic}/0/4")["subscriptions"]["billing"]
        assert moved["state"] == "pending" and moved["rescheduled"] and moved["deliver_at"] < later
        assert lookup(port, f"{topic}/0/99")["state"] == "unknown"
        elsewhere = lookup(port, "not-served/0/0")
        assert elsewhere["state"] == "not-owner" and elsewhere["owner"] is None

        show = [sys.executable, "-m", "sidecar", "messages", "show", f"{topic}/0/3", "--bootstrap-servers", kafka,
                "--group-id", group]  # fmt: skip
        shown = subprocess.run(show, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert shown.returncode == 0, shown.stderr
        assert "fraud: cancelled" in shown.stdout and "billing: pending" in shown.stdout, shown.stdout
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()


def test_the_owner_shows_a_nack_that_another_member_holds(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """A nack lies with the owner of the control partition it came on. The message's owner asks the
    other members, so its answer shows the nack; the other member names the owner."""
    topic, control = topic_factory("lookupnack", partitions=2), topic_factory("ctl", partitions=2)
    group, ports = f"g-{topic}", [free_port(), free_port()]
    rules = policies(topic, policy_file)
    members = []
    for i, port in enumerate(ports):
        args = run_args(kafka, rules, tmp_path / f"state{i}", port, group, "--control-topic", control)
        members.append(SidecarProcess(args, tmp_path / f"log{i}"))
    for partition in (0, 1):
        kafka_helper.produce(topic, b"now", partition=partition)
    kafka_helper.flush()
    client = {"bootstrap.servers": kafka}
    try:
        start_serving(members[0], ports[0])  # in turn: joins 0.3 s apart can wedge the embedded broker's group
        members[1].start()

        def owners() -> dict[tuple[str, int], dict[str, Any]]:
            found = {(t, p): find_owner(client, group, t, p) for t in (topic, control) for p in (0, 1)}
            return {where: owner for where, owner in found.items() if owner is not None}

        wait_for(lambda: len(owned := owners()) == 4 and len({o["member_id"] for o in owned.values()}) == 2, 90,
                 "both members own partitions")  # fmt: skip
        owned = owners()
        # A message on a partition one member owns, nacked on a control partition the other owns.
        partition, other = next(
            (p, c) for p in (0, 1) for c in (0, 1) if owned[(topic, p)]["member_id"] != owned[(control, c)]["member_id"]
        )
        asked, elsewhere = owned[(topic, partition)]["metrics_port"], owned[(control, other)]["metrics_port"]
        assert sorted([asked, elsewhere]) == sorted(ports)
        # Both delivered. At least once, a member that joins while the other delivers may send one
        # again (docs/guides/operators/scaling-out.md, "On the embedded broker"): origins, not a count.
        delivered = lambda: {r.headers[ORIGIN] for r in kafka_helper.read_to_end(f"{topic}.billing")}  # noqa: E731
        wait_for(lambda: delivered() == {f"{topic}/0/0".encode(), f"{topic}/1/0".encode()}, 60, "both delivered")
        nack_at = int(time.time() * 1000) + 600_000
        body = {"v": 1, "type": "nack", "topic": topic, "partition": partition, "offset": 0, "subscription": "billing",
                "deliver_at": nack_at}  # fmt: skip
        message = f"{topic}/{partition}/0"
        producer = Producer(client)
        producer.produce(control, json.dumps(body).encode(), key=f"{topic}/{partition}/0".encode(), partition=other)
        assert producer.flush(10) == 0
        wait_for(lambda: bool(lookup(elsewhere, f"{message}?scope=member")["nacks"]), 60, "the nack accepted")
        answer = lookup(asked, f"{message}")
        assert answer["subscriptions"]["billing"] == {"state": "pending", "deliver_at": nack_at, "nack": True,
                                                      "redelivery_count": 1}  # fmt: skip
        assert answer["state"] == "mixed" and "unreachable" not in answer
        assert lookup(asked, f"{message}?scope=member")["nacks"] == {}, "held by the other member, not the owner"
        named = lookup(elsewhere, f"{message}")
        assert (named["state"], named["owner"]["metrics_port"]) == ("not-owner", asked)
        for member in members:
            assert member.stop() == 0, member.tail()
    finally:
        for member in members:
            member.close()
