"""Exactly-once mode against a real broker: kill -9 and a zombie, counted per record, read_committed.

Each test reads every outbound topic to its high watermark as an outbound consumer does
(isolation.level=read_committed) and counts copies per origin: one duplicate, one loss or one
early record fails it.
"""

import json
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from sidecar.broker.ports import free_port
from sidecar.identity import IDS_FILE
from sidecar.inbound.rebuild import Rebuilder
from sidecar.outbound import writer as writer_module
from sidecar.outbound.writer import Writer
from sidecar.partitions.metadata import CommitMetadata
from sidecar.settings import RunSettings
from tests.kafka_helpers import (
    KafkaHelper,
    LiveReader,
    PolicyFile,
    SidecarProcess,
    ThreadedSidecar,
    TopicFactory,
    assert_once_each,
    assert_records_once_each,
    committed,
    create_topics,
    deliveries,
    outbound_end,
    run_args,
    scrape,
    settings_for,
    start_serving,
    wait_for,
)

EXACTLY_ONCE = ("--processing-guarantee", "exactly-once")


def produce_mixed(kafka_helper: KafkaHelper, topic: str, count: int, first_due: int, spread_ms: int) -> None:
    """Half pass-through, half delayed over `spread_ms`, on two partitions."""
    rng = random.Random(14)
    for i in range(count):
        headers = [] if i % 2 else [("deliver-at", str(first_due + rng.randrange(spread_ms)))]
        kafka_helper.produce(topic, f"v{i}".encode(), headers=headers, partition=i % 2)
    kafka_helper.flush()


@pytest.mark.parametrize("tracker", ["bucket", "memory"])
@pytest.mark.fallback
def test_kill_9_while_delivering_sends_each_record_once_read_committed(
    tracker: str,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
) -> None:
    """Kills land inside open transactions (deliveries every few ms, a commit every 200 ms): what
    they wrote is aborted, and the restart delivers it again, once, from the commit. Counted twice:
    read from offset 0 afterwards, and by a consumer that kept reading through the kills (each
    restart writes under a new producer id, so no later commit shares one with an abort)."""
    topic = topic_factory("eos", partitions=2)
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}, o: {{type: exclusive}}}}\n")
    port, count = free_port(), 4_000
    args = run_args(kafka, policies, tmp_path / "state", port, f"g-{topic}", *EXACTLY_ONCE, "--tracker", tracker)
    sidecar = SidecarProcess(args, tmp_path / "log")
    produce_mixed(kafka_helper, topic, count, int(time.time() * 1000) + 4_000, 8_000)
    create_topics(kafka, [f"{topic}.a", f"{topic}.o"], 2)  # for the live reader to be assigned before the start
    live = LiveReader(kafka, [f"{topic}.a", f"{topic}.o"], 2)
    rng = random.Random(9)
    try:
        sidecar.start()
        for kill in range(3):
            seen = outbound_end(kafka_helper, f"{topic}.a", 2)
            if seen >= count:
                break  # a slow machine: the restarts outlasted the deliveries (the first kill still landed)
            more = lambda s=seen: outbound_end(kafka_helper, f"{topic}.a", 2) > s  # noqa: E731
            wait_for(more, 60, f"deliveries before kill {kill}")
            time.sleep(rng.uniform(0.1, 0.6))
            sidecar.kill()
            sidecar.start()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) >= count, 90, "every record delivered")
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 0, 30, "a checkpoint")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    seen_live = live.finish()
    for sub in ("a", "o"):
        assert_records_once_each(kafka_helper.read_to_end(f"{topic}.{sub}", committed_only=True), sub, count)
        assert_records_once_each(seen_live[f"{topic}.{sub}"], f"{sub} (live reader)", count)
    aborted = len(kafka_helper.read_to_end(f"{topic}.a")) - count
    print(f"records written in aborted transactions: {aborted}")  # what read_uncommitted would duplicate


def test_a_zombie_is_fenced_and_its_writes_never_become_visible(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """A is stopped (SIGSTOP) with a transaction open; B starts with A's instance id on another
    host (its own temporary dir: the host lock does not see A), so with A's group.instance.id: B
    finds A's transactional.id in the commit metadata and fences it, which aborts A's transaction,
    and the group fences A's consumer. Woken up (SIGCONT), A fails, and nothing it wrote is visible."""
    topic = topic_factory("zombie", partitions=2)
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}, o: {{type: exclusive}}}}\n")
    group, count = f"g-{topic}", 3_000
    same = ("--instance-id", f"member-{uuid.uuid4().hex[:6]}", "--commit-interval-ms", "1000", *EXACTLY_ONCE)
    port_a, port_b = free_port(), free_port()
    a = SidecarProcess(run_args(kafka, policies, tmp_path / "a", port_a, group, *same), tmp_path / "a.log")
    (tmp_path / "host-b").mkdir()
    b = SidecarProcess(run_args(kafka, policies, tmp_path / "b", port_b, group, *same), tmp_path / "b.log",
                       env={"TMPDIR": str(tmp_path / "host-b")})  # fmt: skip
    try:
        start_serving(a, port_a)  # then the records: B still finds some due after A stops, however slow A's start
        produce_mixed(kafka_helper, topic, count, int(time.time() * 1000) + 3_000, 10_000)
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) > count // 2 + 100, 60, "A delivering")
        assert a.process is not None
        os.kill(a.process.pid, signal.SIGSTOP)  # with deliveries in its open transaction
        b.start()
        seen = outbound_end(kafka_helper, f"{topic}.a", 2)
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) > seen, 60, "B delivering")
        before = len(a.log.read_text())
        os.kill(a.process.pid, signal.SIGCONT)
        wait_for(lambda: "engine failed" in a.log.read_text()[before:], 60, "A to find itself fenced")
        a.kill()  # before its next engine fences B in turn (two live sidecars must not share an id)
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) >= count, 90, "every record delivered")
        wait_for(lambda: scrape(port_b, "delay_sidecar_tracked_messages", topic=topic) == 0, 60, "B's checkpoint")
        assert b.stop() == 0, b.tail()
    finally:
        a.close()
        b.close()
    woken = a.log.read_text()[before:]
    assert "fenced" in woken, woken[-3000:]  # by the producer's epoch or the group's instance id
    assert_once_each(kafka_helper, f"{topic}.a", count)
    assert_once_each(kafka_helper, f"{topic}.o", count)


def test_a_zombie_stopped_inside_its_commit_does_not_hold_up_its_successor(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stops (as SIGSTOP would) between sending its offsets to its transaction and committing it:
    the group's commit is unstable until that transaction ends, and a read_committed consumer's
    offset fetch waits for it. B, A's successor on another host, must fence A first and read
    after: waiting instead held B up until the broker aborted A's transaction (the transaction
    timeout; found by the zombie test in CI, where B failed its engine once after 60 s). A's timeout
    is 10 min here, so only the fence lets B deliver."""
    topic = topic_factory("stopped", partitions=2)
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    group, count, member = f"g-{topic}", 2_000, f"member-{uuid.uuid4().hex[:6]}"
    monkeypatch.setattr(writer_module, "TRANSACTION_TIMEOUT_MS", 600_000)  # A's only: B is a process of its own
    stop, stopped, release = threading.Event(), threading.Event(), threading.Event()
    real_commit = Writer.commit

    def commit_then_stop(self: Writer, offsets: list[Any], group_metadata: object) -> None:
        if offsets and stop.is_set() and not stopped.is_set():
            self.flush()
            self.producer.send_offsets_to_transaction(offsets, group_metadata, 30)
            stopped.set()
            release.wait(300)
        real_commit(self, offsets, group_metadata)

    monkeypatch.setattr(Writer, "commit", commit_then_stop)
    settings = settings_for(kafka, policies, tmp_path / "a", group_id=group, instance_id=member,
                            commit_interval_ms=1_000, processing_guarantee="exactly-once")  # fmt: skip
    (tmp_path / "host-b").mkdir()
    port_b = free_port()
    b = SidecarProcess(run_args(kafka, policies, tmp_path / "b", port_b, group, "--instance-id", member, *EXACTLY_ONCE),
                       tmp_path / "b.log", env={"TMPDIR": str(tmp_path / "host-b")})  # fmt: skip
    a = ThreadedSidecar(settings)
    try:
        a.__enter__()
        produce_mixed(kafka_helper, topic, count, int(time.time() * 1000) + 2_000, 8_000)
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) > count // 2 + 100, 60, "A delivering")
        stop.set()
        wait_for(stopped.is_set, 30, "A to stop inside a commit")
        b.start()
        delivered = lambda: len(deliveries(kafka_helper.read_to_end(f"{topic}.a", committed_only=True)))  # noqa: E731
        wait_for(lambda: delivered() >= count, 120, "B to deliver every record while A's transaction is open")
        assert not release.is_set()
        assert "engine failed" not in b.log.read_text(), b.tail()
        assert b.stop() == 0, b.tail()
    finally:
        b.close()
        release.set()
        a.app.stop()
        a.thread.join(60)
    assert_once_each(kafka_helper, f"{topic}.a", count)


def test_a_zombie_that_commits_between_the_read_of_the_commit_and_its_fence_is_not_delivered_twice(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B takes A's partitions (A's instance id, another host): it reads the commit, which names A's
    producer, and fences that producer. A keeps delivering and committing until the fence, so the
    commit B read first may be stale by then; starting from it delivers A's last transactions again
    (found by the chaos test's zombie step: 274 duplicates). Here A's commit is made to move between
    B's read and B's fence, every time."""
    topic = topic_factory("race", partitions=2)
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    group, count, member = f"g-{topic}", 2_000, f"member-{uuid.uuid4().hex[:6]}"
    (tmp_path / "host-a").mkdir()
    port_a = free_port()
    args = run_args(kafka, policies, tmp_path / "a", port_a, group, "--instance-id", member, *EXACTLY_ONCE)
    a = SidecarProcess(args, tmp_path / "a.log", env={"TMPDIR": str(tmp_path / "host-a")})
    real_fence = Writer.fence
    moved: list[bool] = []

    def fence_after_a_commit(self: Writer, transactional_id: str) -> None:
        if not moved and a.process is not None and a.process.poll() is None:
            read = committed(kafka, group, topic, 2)
            changed = lambda: committed(kafka, group, topic, 2) != read  # noqa: E731
            deadline = time.monotonic() + 30
            while not changed() and time.monotonic() < deadline:
                time.sleep(0.05)
            moved.append(changed())
        real_fence(self, transactional_id)
        a.kill()  # fenced: before its next engine fences B in turn

    monkeypatch.setattr(Writer, "fence", fence_after_a_commit)
    settings = settings_for(kafka, policies, tmp_path / "b", group_id=group, instance_id=member,
                            processing_guarantee="exactly-once")  # fmt: skip
    create_topics(kafka, [f"{topic}.a"], 2)  # for the live reader to be assigned before the start
    live = LiveReader(kafka, [f"{topic}.a"], 2)
    try:
        start_serving(a, port_a)  # A still has records pending when B takes over, however slow its start
        produce_mixed(kafka_helper, topic, count, int(time.time() * 1000) + 2_000, 8_000)
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) > count // 2 + 100, 60, "A delivering")
        with ThreadedSidecar(settings) as b:
            wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) >= count, 90, "every record delivered")
            wait_for(lambda: b.metric("delay_sidecar_tracked_messages", topic=topic) == 0, 60, "B's last delivery")
    finally:
        a.close()
    assert moved == [True], "A's commit never moved between B's read and its fence: the race was not run"
    assert_once_each(kafka_helper, f"{topic}.a", count)
    assert_records_once_each(live.finish()[f"{topic}.a"], "a (live reader)", count)


def test_a_rebuilding_partition_names_its_new_producer_in_the_commit_before_it_writes(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partition being rebuilt commits nothing, yet its producer may write (records of ordered
    subscriptions past the rebuild's end). Unless the commit names that producer, a successor of
    the same identity fences only the earlier one, and on a broker without KIP-447 the zombie's
    transaction commits: duplicates (found by the chaos test's zombie step). Here the rebuild is
    held at its first record: the commit must name the new producer all the same."""
    topic = topic_factory("claim")
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    group = f"g-{topic}"

    def settings(state_dir: Path) -> RunSettings:
        return settings_for(kafka, policies, state_dir, group_id=group, instance_id="claimer", state_topic="none",
                            processing_guarantee="exactly-once")  # fmt: skip

    later = str(int(time.time() * 1000) + 3_600_000)
    for i in range(200):
        kafka_helper.produce(topic, f"v{i}".encode(), headers=[("deliver-at", later)])
    kafka_helper.flush()

    def producer() -> str | None:
        return CommitMetadata.decode(committed(kafka, group, topic, 1)[0][1]).producer

    with ThreadedSidecar(settings(tmp_path / "first")) as first:
        first.wait_for_metric("delay_sidecar_messages_delayed_total", 200, 60, topic=topic)
        wait_for(lambda: producer() is not None, 60, "the first sidecar's commit")
    earlier = producer()
    held = threading.Event()
    release = threading.Event()
    rebuild = Rebuilder.take

    def hold(self: Rebuilder, *args: Any, **kwargs: Any) -> int:
        held.set()
        release.wait(120)
        return rebuild(self, *args, **kwargs)

    monkeypatch.setattr(Rebuilder, "take", hold)
    try:
        with ThreadedSidecar(settings(tmp_path / "second")):  # a lost state dir: a rebuild
            wait_for(held.is_set, 60, "the rebuild to start")
            own = json.loads((tmp_path / "second" / IDS_FILE).read_text())["open"][-1]
            wait_for(lambda: producer() == own, 60, f"the commit to name {own} (it names {producer()})")
            assert own != earlier
            release.set()
    finally:
        release.set()
