"""Consumer-side delayed nacks through the control topic, against a real broker (contract section 5)."""

import json
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from sidecar.broker.ports import free_port
from sidecar.client import Nacker
from sidecar.control import redelivery
from sidecar.dispatch.reader import LogReader
from sidecar.engine import CONTROL_SLICE
from sidecar.outbound.records import DELIVER_AT, ERROR_CODE, ORIGIN_OFFSET, ORIGIN_PARTITION, REDELIVERY_COUNT
from tests.kafka_helpers import (
    KafkaHelper,
    LiveReader,
    PolicyFile,
    Received,
    SidecarProcess,
    ThreadedSidecar,
    TopicFactory,
    accepted_lines,
    committed,
    early,
    run_args,
    scrape,
    settings_for,
    settled_control,
    start_serving,
    wait_for,
)


class RecordView:
    """A Received record seen through the interface sidecar.client reads (a confluent Message)."""

    def __init__(self, record: Received) -> None:
        self._record = record

    def headers(self) -> list[tuple[str, bytes]]:
        return list(self._record.wire or self._record.headers.items())

    def topic(self) -> str:
        return self._record.topic


def setup(topic: str, policy_file: PolicyFile, max_delay: str = "0") -> Path:
    return policy_file(f"""
topics:
  {topic}:
    delayed_delivery: {{max_delivery_delay: {max_delay}}}
    subscriptions: {{billing: {{}}, fraud: {{}}}}
""")


@pytest.mark.parametrize("recent", [64 << 20, 0])
@pytest.mark.fallback
def test_each_nacked_message_comes_back_once_on_its_own_subscription(
    recent: int,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
) -> None:
    """The nacked records come from what intake kept (--recent-records-bytes), or without it from the log."""
    topic, control = topic_factory("nack"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(
        kafka, setup(topic, policy_file), tmp_path, control_topic=control, recent_records_bytes=recent
    )
    with ThreadedSidecar(settings) as sidecar:
        for i in range(20):
            kafka_helper.produce(topic, f"v{i}".encode())
        kafka_helper.flush()
        first = kafka_helper.read(f"{topic}.billing", 20)
        nacker = Nacker(Producer({"bootstrap.servers": kafka}), control_topic=control, subscription="billing")
        nacked_at = {}
        for record in first:
            nacker.nack(RecordView(record), 1000)  # type: ignore[arg-type]
            nacked_at[record.headers[ORIGIN_OFFSET]] = time.time() * 1000
        nacker.flush()
        billing = kafka_helper.read(f"{topic}.billing", 40, timeout_s=20, extra_s=1.5)
        again = [r for r in billing if r.headers[REDELIVERY_COUNT] == b"1"]
        assert len(billing) == 40 and len(again) == 20
        assert sorted(r.headers[ORIGIN_OFFSET] for r in again) == sorted(nacked_at)
        for r in again:
            assert r.timestamp >= r.header_int(DELIVER_AT), "redelivered early"
            assert r.received_ms - nacked_at[r.headers[ORIGIN_OFFSET]] >= 1000 - 50
            assert r.value == b"v" + r.headers[ORIGIN_OFFSET]
        fraud = kafka_helper.read(f"{topic}.fraud", 20, extra_s=1.0)
        assert len(fraud) == 20 and all(r.headers[REDELIVERY_COUNT] == b"0" for r in fraud)
        assert sidecar.metric("delay_sidecar_redeliveries_total", subscription="billing") == 20
        assert sidecar.metric("delay_sidecar_nack_total", subscription="billing", result="accepted") == 20
        source = "recent" if recent else "log"
        assert sidecar.metric("delay_sidecar_payload_reads_total", topic=topic, source=source) == 20


def test_latest_nack_for_the_same_message_wins(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, control = topic_factory("latest"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka, setup(topic, policy_file), tmp_path, control_topic=control)
    with ThreadedSidecar(settings):
        kafka_helper.produce(topic, b"m")
        kafka_helper.flush()
        [record] = kafka_helper.read(f"{topic}.billing", 1)
        nacker = Nacker(Producer({"bootstrap.servers": kafka}), control_topic=control, subscription="billing")
        sent = time.time() * 1000  # before the commands take their timestamps: the delay counts from those
        nacker.nack(RecordView(record), 600_000)  # type: ignore[arg-type]
        nacker.nack(RecordView(record), 1500)  # type: ignore[arg-type]
        nacker.flush()
        records = kafka_helper.read(f"{topic}.billing", 2, timeout_s=10, extra_s=2.0)
        assert [r.headers[REDELIVERY_COUNT] for r in records] == [b"0", b"1"]
        assert records[1].received_ms - sent >= 1500
        # And the other way round: a later, longer nack replaces a shorter one, however long the two
        # take to be judged (the shorter one must not fall due in between).
        nacker.nack(RecordView(records[1]), 3000)  # type: ignore[arg-type]
        nacker.nack(RecordView(records[1]), 600_000)  # type: ignore[arg-type]
        nacker.flush()
        assert len(kafka_helper.read(f"{topic}.billing", 3, timeout_s=6)) == 2


def test_invalid_commands_get_their_own_code_and_the_sidecar_keeps_serving(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic, control = topic_factory("badnack"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka, setup(topic, policy_file, max_delay="1m"), tmp_path, control_topic=control)
    with ThreadedSidecar(settings) as sidecar:
        kafka_helper.produce(topic, b"m")
        kafka_helper.flush()
        kafka_helper.read(f"{topic}.billing", 1)

        def nack(**fields: object) -> bytes:
            body = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0, "offset": 0,
                    "delay_ms": 1000}  # fmt: skip
            body.update(fields)
            return json.dumps(body).encode()

        # One control partition, so the origin offsets give the order sent.
        for value in (b"{oops", nack(subscription="nobody"), nack(offset=99), nack(delay_ms=120_000)):
            kafka_helper.produce(control, value, partition=0)
        kafka_helper.produce(control, nack(), partition=0)
        kafka_helper.flush()
        dead = kafka_helper.read(f"{control}.dlt", 4, extra_s=0.5)
        dead.sort(key=lambda r: int(r.headers[ORIGIN_OFFSET]))  # unkeyed: spread over the DLT's partitions
        assert [r.headers[ERROR_CODE] for r in dead] == [
            b"INVALID_COMMAND", b"UNKNOWN_SUBSCRIPTION", b"UNKNOWN_MESSAGE", b"EXCEEDS_MAX_DELAY"
        ]  # fmt: skip
        assert dead[0].value == b"{oops"
        # The valid command after them still works.
        assert [r.headers[REDELIVERY_COUNT] for r in kafka_helper.read(f"{topic}.billing", 2)] == [b"0", b"1"]
        # A command's subscription becomes a metric label only when it is configured.
        samples = sidecar.app.metrics.registry.get_sample_value
        assert samples("delay_sidecar_nack_total", {"subscription": "nobody", "result": "unknown_subscription"}) is None
        assert samples("delay_sidecar_nack_total", {"subscription": "(unknown)", "result": "unknown_subscription"}) == 1


def test_a_nack_of_a_dead_lettered_message_is_refused_when_it_falls_due_and_the_others_come_back(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """A nack is accepted for any offset the log holds; when it falls due, its message is judged
    again, so one that went to the dead-letter topic never reaches the subscription
    (docs/guides/consumers.md, UNKNOWN_MESSAGE). Nacks of one batch for the same partition are
    redelivered around it."""
    topic, control = topic_factory("deadnack"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka, setup(topic, policy_file, max_delay="1m"), tmp_path, control_topic=control)
    with ThreadedSidecar(settings) as sidecar:
        kafka_helper.produce(topic, b"ok-0")
        kafka_helper.produce(topic, b"too-far", headers=[("deliver-after", "2h")])
        kafka_helper.produce(topic, b"ok-2")
        kafka_helper.flush()
        kafka_helper.read(f"{topic}.billing", 2)
        [dead_letter] = kafka_helper.read(f"{topic}.dlt", 1)
        assert dead_letter.headers[ERROR_CODE] == b"EXCEEDS_MAX_DELAY"
        for offset in (0, 1, 2):
            body = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0,
                    "offset": offset, "delay_ms": 500}  # fmt: skip
            kafka_helper.produce(control, json.dumps(body).encode(), key=f"{topic}/0/{offset}".encode(), partition=0)
        kafka_helper.flush()
        [refused] = kafka_helper.read(f"{control}.dlt", 1, extra_s=1.0)
        assert (refused.headers[ERROR_CODE], json.loads(refused.value)["offset"]) == (b"UNKNOWN_MESSAGE", 1)
        wait_for(lambda: len(kafka_helper.read_to_end(f"{topic}.billing")) == 4, 30, "both redelivered")
        delivered = Counter(
            (r.value, r.headers[REDELIVERY_COUNT]) for r in kafka_helper.read_to_end(f"{topic}.billing")
        )
        assert delivered == Counter({(b"ok-0", b"0"): 1, (b"ok-2", b"0"): 1, (b"ok-0", b"1"): 1, (b"ok-2", b"1"): 1})
        assert sidecar.metric("delay_sidecar_nack_total", subscription="billing", result="unknown_message") == 1


def test_a_nack_whose_subscription_leaves_the_policies_before_it_falls_due_is_refused_then(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A nack accepted shortly before its deliver-at has its redelivery built at acceptance
    (control/redelivery.py, `prepare`). A policy change before it falls due drops what was built: the
    nack is judged against the policies in force at its deliver-at, so with its subscription gone it
    is refused with UNKNOWN_SUBSCRIPTION, and nothing reaches that subscription's outbound topic."""
    # Built ahead even at 8 s, so the policy edit has seconds to land before the nack falls due.
    monkeypatch.setattr(redelivery, "PREPARE_AHEAD_MS", 60_000)
    topic, control = topic_factory("leftnack"), f"ctl-{uuid.uuid4().hex[:8]}"
    policies = setup(topic, policy_file)
    with ThreadedSidecar(settings_for(kafka, policies, tmp_path, control_topic=control)) as sidecar:
        kafka_helper.produce(topic, b"v0")
        kafka_helper.flush()
        kafka_helper.read(f"{topic}.billing", 1)
        body = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0, "offset": 0,
                "delay_ms": 8_000}  # fmt: skip
        kafka_helper.produce(control, json.dumps(body).encode(), key=f"{topic}/0/0".encode(), partition=0)
        kafka_helper.flush()
        sidecar.wait_for_metric("delay_sidecar_nack_total", subscription="billing", result="accepted")
        policies.write_text(f"topics:\n  {topic}:\n    subscriptions: {{fraud: {{}}}}\n")
        assert sidecar.wait_for_metric("delay_sidecar_policy_generation", at_least=2) == 2
        [refused] = kafka_helper.read(f"{control}.dlt", 1, timeout_s=60)
        assert refused.headers[ERROR_CODE] == b"UNKNOWN_SUBSCRIPTION"
        assert sidecar.metric("delay_sidecar_nack_total", subscription="billing", result="unknown_subscription") == 1
    assert [r.headers.get(REDELIVERY_COUNT, b"0") for r in kafka_helper.read_to_end(f"{topic}.billing")] == [b"0"]


def test_1000_nacks_survive_kill_9_and_a_lost_state_dir_through_the_state_topic(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """After kill -9 and a lost state dir, the pending nacks come from the state topic: the control log
    is not read again (without the nacks there, every command and accepted record was: 2,400 here),
    each nack comes back once, and the latest of two nacks for a message wins across the restore."""
    topic, control = topic_factory("nackcrash", partitions=2), f"ctl-{uuid.uuid4().hex[:8]}"
    group, port, state = f"g-{control}", free_port(), tmp_path / "state"
    args = ["--bootstrap-servers", kafka, "--policies", str(setup(topic, policy_file)), "--state-dir", str(state),
            "--metrics-port", str(port), "--group-id", group, "--control-topic", control,
            "--commit-interval-ms", "100"]  # fmt: skip
    sidecar = SidecarProcess(args, tmp_path / "sidecar.log")
    try:
        sidecar.start()
        for i in range(1000):
            kafka_helper.produce(topic, f"v{i}".encode(), partition=i % 2)
        kafka_helper.flush()
        delivered = kafka_helper.read(f"{topic}.billing", 1000, timeout_s=30)
        assert len(delivered) == 1000, sidecar.tail()
        nacker = Nacker(Producer({"bootstrap.servers": kafka}), control_topic=control, subscription="billing")
        sent_ms = time.time() * 1000
        for record in delivered:
            nacker.nack(RecordView(record), 8_000)  # type: ignore[arg-type]
        for record in delivered[:100]:
            nacker.nack(RecordView(record), 10_000)  # type: ignore[arg-type]  # later and longer: it wins
        for record in delivered[100:200]:
            nacker.nack(RecordView(record), 6_000)  # type: ignore[arg-type]  # later and shorter: it wins
        nacker.flush()
        flushed_ms = time.time() * 1000
        # Every command judged and its accepted record indexed and committed, and the state topic
        # holding the control partitions' nacks up to there.
        commits = lambda: [o for o, _ in committed(kafka, group, control, 3)]  # noqa: E731
        wait_for(lambda: settled_control(kafka, kafka_helper, group, control, 1_200), 30, "the nacks accepted")
        wait_for(lambda: _manifest_tails(kafka_helper, f"{group}.state", control) == commits(), 30, "the manifests")
        sidecar.kill()
        killed_ms = time.time() * 1000
        shutil.rmtree(state)
        sidecar.start()
        wait_for(lambda: scrape(port, "delay_sidecar_redeliveries_total", subscription="billing") >= 1000, 60,
                 "the redeliveries")  # fmt: skip
        control_replayed = scrape(port, "delay_sidecar_messages_replayed_total", topic=control)
        restored = scrape(port, "delay_sidecar_state_restores_total", result="state-topic")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert control_replayed == 0, "the control log was read again"
    assert restored == 3, "not every control partition was loaded from the state topic"
    records = kafka_helper.read_to_end(f"{topic}.billing")
    assert not early(records)
    again: dict[tuple[int, int], list[int]] = {}
    for r in records:
        if r.headers[REDELIVERY_COUNT] == b"1":
            again.setdefault((int(r.headers[ORIGIN_PARTITION]), int(r.headers[ORIGIN_OFFSET])), []).append(
                r.header_int(DELIVER_AT)
            )
    assert len(again) == 1000
    for at in again.values():  # a copy before the kill is at least once; none due after it was sent then
        assert len(at) == 1 or (len(at) == 2 and at[0] == at[1] and at[0] <= killed_ms), at
    origin = lambda r: (r.partition, int(r.headers[ORIGIN_OFFSET]))  # noqa: E731
    assert all(again[origin(r)][0] >= sent_ms + 10_000 for r in delivered[:100])
    assert all(again[origin(r)][0] <= flushed_ms + 6_000 for r in delivered[100:200])
    assert all(sent_ms + 8_000 <= again[origin(r)][0] <= flushed_ms + 8_000 for r in delivered[200:])


def _manifest_tails(kafka_helper: KafkaHelper, state_topic: str, control: str) -> list[int]:
    """The tail of each control partition's last manifest in the state topic (-1 without one)."""
    tails = [-1, -1, -1]
    for record in kafka_helper.read_to_end(state_topic):
        key = (record.key or b"").decode()
        if key.startswith(f"{control}/") and key.endswith("/manifest") and record.value is not None:
            tails[int(key.split("/")[1])] = json.loads(record.value)["tail"]
    return tails


def test_nacks_already_due_when_read_are_redelivered_not_dropped(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """A sidecar that reads commands after their time (a backlog, a restart) redelivers them at once."""
    topic, control = topic_factory("latenack"), f"ctl-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka, setup(topic, policy_file), tmp_path, control_topic=control)
    with ThreadedSidecar(settings) as sidecar:
        for i in range(300):
            kafka_helper.produce(topic, f"v{i}".encode())
        kafka_helper.flush()
        first = kafka_helper.read(f"{topic}.billing", 300)
        sent_long_ago = int(time.time() * 1000) - 10_000
        for record in first:
            command = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0,
                       "offset": int(record.headers[ORIGIN_OFFSET]), "delay_ms": 1000}  # fmt: skip
            kafka_helper.produce(control, json.dumps(command).encode(), timestamp=sent_long_ago)
        kafka_helper.flush()
        again = [
            r for r in kafka_helper.read(f"{topic}.billing", 600, timeout_s=20) if r.headers[REDELIVERY_COUNT] == b"1"
        ]
        assert len({r.headers[ORIGIN_OFFSET] for r in again}) == 300
        assert sidecar.metric("delay_sidecar_redeliveries_total", subscription="billing") == 300


def test_nacks_due_when_judged_after_a_restart_read_their_payloads_back_together(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted sidecar no longer keeps the nacked payloads (dispatch/recent.py), so commands that
    are due when judged redeliver payloads read back from the log. Each read costs a fetch round
    trip, so the reads of a consumed batch go together, not one per slice of commands (which held
    a restart's backlog of nacks to about 6,000 a second). Each record still comes back once."""
    topic, control, count = topic_factory("readback"), f"ctl-{uuid.uuid4().hex[:8]}", 2_000
    settings = settings_for(kafka, setup(topic, policy_file), tmp_path, control_topic=control)
    with ThreadedSidecar(settings):
        for i in range(count):
            kafka_helper.produce(topic, f"v{i}".encode())
        kafka_helper.flush()
        wait_for(lambda: len(kafka_helper.read_to_end(f"{topic}.billing")) == count, 60, "the first deliveries")
    nack_all(kafka_helper, control, topic, count, timestamp=int(time.time() * 1000) - 10_000, delay_ms=1000)
    reads: list[int] = []
    read = LogReader.read

    def counted(reader: LogReader, wanted: dict[tuple[str, int], list[int]]) -> Iterator[Any]:
        reads.append(sum(map(len, wanted.values())))
        return read(reader, wanted)

    monkeypatch.setattr(LogReader, "read", counted)
    with ThreadedSidecar(settings) as sidecar:
        sidecar.wait_for_metric("delay_sidecar_redeliveries_total", count, subscription="billing")
        assert sidecar.metric("delay_sidecar_payload_reads_total", topic=topic, source="log") == count
    assert sum(reads) == count
    assert len(reads) * CONTROL_SLICE < count, f"a read per slice of commands: {reads}"
    records = kafka_helper.read_to_end(f"{topic}.billing")
    redelivered = Counter(int(r.headers[ORIGIN_OFFSET]) for r in records if r.headers[REDELIVERY_COUNT] == b"1")
    assert redelivered == Counter(range(count))


def deliver_first(
    kafka_helper: KafkaHelper, args: list[str], log: Path, topic: str, count: int, committed: bool = False
) -> None:
    """`count` records produced and delivered to `billing` by a sidecar that then stops cleanly."""
    for i in range(count):
        kafka_helper.produce(topic, f"v{i}".encode())
    kafka_helper.flush()
    first = SidecarProcess(args, log)
    try:
        first.start()
        wait_for(lambda: len(kafka_helper.read_to_end(f"{topic}.billing", committed_only=committed)) == count, 60,
                 "the first deliveries")  # fmt: skip
        assert first.stop() == 0, first.tail()
    finally:
        first.close()


def nack_all(kafka_helper: KafkaHelper, control: str, topic: str, count: int, timestamp: int = 0, **when: int) -> None:
    """A nack of each of offsets 0 to count - 1 for `billing`, with `when` (delay_ms or deliver_at)."""
    for offset in range(count):
        command = {"v": 1, "type": "nack", "subscription": "billing", "topic": topic, "partition": 0,
                   "offset": offset, **when}  # fmt: skip
        kafka_helper.produce(control, json.dumps(command).encode(), timestamp=timestamp)
    kafka_helper.flush()


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_a_nack_due_when_judged_is_redelivered_without_an_accepted_record_and_survives_a_kill_before_the_commit(
    mode: str, kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile,
    tmp_path: Path,
) -> None:  # fmt: skip
    """A nack already due when it is judged goes out in the same slice, before any checkpoint can
    commit its command's offset, so it writes no accepted record. Killed before that commit (and the
    state dir lost), the next run judges the command again: redelivered at least once, and exactly
    once in exactly-once mode, read from offset 0 and by a consumer that kept reading."""
    topic, control = topic_factory("duenack"), f"ctl-{uuid.uuid4().hex[:8]}"
    port, group, state = free_port(), f"g-{topic}", tmp_path / "state"
    args = run_args(kafka, setup(topic, policy_file), state, port, group, "--control-topic", control,
                    "--processing-guarantee", mode)  # fmt: skip
    committed = mode == "exactly-once"
    deliver_first(kafka_helper, args, tmp_path / "log1", topic, 50, committed)
    live = LiveReader(kafka, [f"{topic}.billing"], 1) if committed else None
    # No checkpoint for ten minutes: the kill comes before the commit of the nacks' offsets.
    slow = SidecarProcess([*args, "--commit-interval-ms", "600000"], tmp_path / "log2")
    again = SidecarProcess(args, tmp_path / "log3")
    try:
        start_serving(slow, port)
        nack_all(kafka_helper, control, topic, 50, timestamp=int(time.time() * 1000) - 10_000, delay_ms=1000)

        def written() -> int:  # read_uncommitted: the transaction of exactly-once stays open
            return sum(r.headers[REDELIVERY_COUNT] == b"1" for r in kafka_helper.read_to_end(f"{topic}.billing"))

        wait_for(lambda: written() == 50, 60, "the redeliveries written")
        types = [json.loads(r.value or b"{}").get("type") for r in kafka_helper.read_to_end(control)]
        assert types == ["nack"] * 50, "no accepted record for a nack that was due when judged"
        slow.kill()
        shutil.rmtree(state)
        again.start()
        wait_for(lambda: scrape(port, "delay_sidecar_redeliveries_total", subscription="billing") >= 50, 60,
                 "judged and redelivered again")  # fmt: skip
        time.sleep(1.0)  # a checkpoint after them
        assert again.stop() == 0, again.tail()
    finally:
        slow.close()
        again.close()
    kept = live.finish() if live is not None else {}
    fresh = kafka_helper.read_to_end(f"{topic}.billing", committed_only=committed)
    for records in (fresh, *([kept[f"{topic}.billing"]] if live is not None else [])):
        redelivered = Counter(int(r.headers[ORIGIN_OFFSET]) for r in records if r.headers[REDELIVERY_COUNT] == b"1")
        assert set(redelivered) == set(range(50)), redelivered
        if committed:
            assert redelivered == Counter(range(50)), redelivered
        assert not early(records)


def test_a_command_judged_again_after_a_crash_is_redelivered_when_its_old_accepted_record_comes_back(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """At least once: a run accepts nacks (not due yet, so it writes their accepted records) and is
    killed before it commits their offsets. The next run judges the commands again when they are
    due already, and then reads the old accepted records in the same batch. Those must not settle
    the nacks that the new judgement is about to redeliver."""
    topic, control = topic_factory("rejudged"), f"ctl-{uuid.uuid4().hex[:8]}"
    port, group, state = free_port(), f"g-{topic}", tmp_path / "state"
    args = run_args(kafka, setup(topic, policy_file), state, port, group, "--control-topic", control,
                    "--state-topic", "none")  # fmt: skip
    deliver_first(kafka_helper, args, tmp_path / "log1", topic, 20)
    slow = SidecarProcess([*args, "--commit-interval-ms", "600000"], tmp_path / "log2")
    again = SidecarProcess(args, tmp_path / "log3")
    try:
        start_serving(slow, port)
        deliver_at = int(time.time() * 1000) + 6_000  # judged before it: accepted records are written
        nack_all(kafka_helper, control, topic, 20, deliver_at=deliver_at)

        wait_for(lambda: accepted_lines(kafka_helper, control) == 20, 30, "the accepted records written")
        slow.kill()  # before the nacks are due, and before any commit of their offsets
        wait_for(lambda: time.time() * 1000 > deliver_at + 500, 30, "the nacks due")
        start_serving(again, port)
        wait_for(lambda: scrape(port, "delay_sidecar_redeliveries_total", subscription="billing") >= 20, 60, "20")
        assert again.stop() == 0, again.tail()
    finally:
        slow.close()
        again.close()
    records = kafka_helper.read_to_end(f"{topic}.billing")
    redelivered = Counter(int(r.headers[ORIGIN_OFFSET]) for r in records if r.headers[REDELIVERY_COUNT] == b"1")
    assert set(redelivered) == set(range(20)), f"not redelivered: {sorted(set(range(20)) - set(redelivered))}"
    assert not early(records)
