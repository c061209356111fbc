"""Restarts against a real broker: what a checkpoint makes durable, counted per record.

Each test reads every outbound topic to its high watermark and counts copies per origin, so a
duplicate fails it as surely as a loss.
"""

import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from sidecar.broker.ports import free_port
from sidecar.clock import SystemClock
from sidecar.engine import Sidecar
from sidecar.partitions.metadata import CommitMetadata
from sidecar.policy import load_policies
from sidecar.tracker import InMemoryTracker
from sidecar.tracker.base import pack
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.storage.fake import FakeSnapshotStorage
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    SidecarProcess,
    TopicFactory,
    assert_once_each,
    committed,
    outbound_end,
    produce_due,
    run_args,
    scrape,
    start_serving,
    wait_for,
)

RESTART_S = 180.0
"""After a (re)start: a kill -9 leaves the old member in the group until its session times out, and in
CI a restart under load took 57 s to be assigned anything."""


def assigned(port: int) -> bool:
    """The process on `port` owns partitions. Until then its tracked gauge reads 0: it has restored nothing."""
    return scrape(port, "delay_sidecar_assigned_partitions") > 0


def committed_to_end(kafka: str, kafka_helper: KafkaHelper, group: str, topic: str, partitions: int) -> bool:
    """The group's commit is at the end of every inbound partition: every record taken in and checkpointed."""
    return [o for o, _ in committed(kafka, group, topic, partitions)] == kafka_helper.end_offsets(topic, partitions)


def settled(kafka: str, kafka_helper: KafkaHelper, group: str, topic: str, partitions: int) -> bool:
    """The group's commit is at the end of every inbound partition with nothing pending: every record
    delivered and checkpointed, as the broker says. Not the tracked gauge: at least once, it is set
    before the commit, which waits for the index's fsync (checkpoint.py)."""
    commits = committed(kafka, group, topic, partitions)
    ends = kafka_helper.end_offsets(topic, partitions)
    return [o for o, _ in commits] == ends and all(CommitMetadata.decode(m).earliest == o for o, m in commits)


def test_deliveries_after_a_restart_are_checkpointed_without_new_inbound_records(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """A restart that only delivers must still checkpoint: a kill -9 after it must not send it all again."""
    topic = topic_factory("redeliver", partitions=2)
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}, o: {{type: exclusive}}}}\n")
    port = free_port()
    sidecar = SidecarProcess(run_args(kafka, policies, tmp_path / "state", port, f"g-{topic}"), tmp_path / "log")
    count = 2_000
    try:
        start_serving(sidecar, port)  # deliver-ats from now: none is due at intake however slow the start
        due = int(time.time() * 1000) + 6_000
        produce_due(kafka_helper, topic, [due + i % 1000 for i in range(count)], partitions=2)
        # Every record taken in and committed; not the gauge at `count`, then a kill -9 "before anything is due":
        # on a loaded machine records can fall due first (the gauge never reads `count`, or the kill redelivers).
        wait_for(lambda: committed_to_end(kafka, kafka_helper, f"g-{topic}", topic, 2), 60, "every record taken in")
        # A clean stop: what fell due before it is committed with it, and the restart delivers the rest.
        assert sidecar.stop() == 0, sidecar.tail()
        for _ in range(3):
            sidecar.start()
            wait_for(lambda: assigned(port), RESTART_S, "the restart serving")  # its gauge reads 0 until then
            wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a", 2) >= count, RESTART_S, "every record delivered")
            # The commit itself: the gauge reads 0 before a restart restored anything, and before an fsync's commit.
            wait_for(
                lambda: settled(kafka, kafka_helper, f"g-{topic}", topic, 2), RESTART_S, "a commit of every delivery"
            )
            wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 0, 30, "a checkpoint")
            sidecar.kill()
        sidecar.start()
        wait_for(lambda: assigned(port), RESTART_S, "the restart serving")  # its gauge reads 0 until then
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 0, 30, "a checkpoint")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", count)
    assert_once_each(kafka_helper, f"{topic}.o", count)


def test_a_clean_restart_delivers_every_record_exactly_once(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """The in-memory index is rebuilt after every restart: from the earliest pending offset, it must
    skip what was delivered before the stop (the delivered watermark), not send it again."""
    topic = topic_factory("clean")
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    port = free_port()
    args = run_args(kafka, policies, tmp_path / "state", port, f"g-{topic}", "--tracker", "memory")
    sidecar = SidecarProcess(args, tmp_path / "log")
    try:
        start_serving(sidecar, port)
        now = int(time.time() * 1000)
        # Interleaved: the early half is delivered before the stop, the late half is still pending.
        produce_due(kafka_helper, topic, [now + (3_000 if i % 2 == 0 else 12_000) for i in range(1_000)])
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") == 500, 60, "the early half")
        assert sidecar.stop() == 0, sidecar.tail()
        sidecar.start()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= 1_000, 60, "the late half")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", 1_000)
    assert "index rebuild done" in sidecar.log.read_text()


def test_a_stale_state_dir_is_discarded_after_another_member_owned_the_partition(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """A -> B -> A: A's state dir predates what B delivered and committed; A must not redeliver it."""
    topic = topic_factory("handoff")
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    port, group = free_port(), f"g-{topic}"
    same_member = ("--instance-id", f"member-{uuid.uuid4().hex[:6]}")  # B takes A's place in the group
    a = SidecarProcess(run_args(kafka, policies, tmp_path / "a", port, group, *same_member), tmp_path / "a.log")
    b = SidecarProcess(run_args(kafka, policies, tmp_path / "b", port, group, *same_member), tmp_path / "b.log")
    try:
        start_serving(a, port)
        produce_due(kafka_helper, topic, [int(time.time() * 1000) + 5_000] * 200)
        wait_for(lambda: scrape(port, "delay_sidecar_messages_delayed_total", topic=topic) == 200, 60, "A indexing")
        assert a.stop() == 0, a.tail()
        b.start()  # no local state: rebuilds from the commit, then delivers when due
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= 200, 60, "B delivering")
        assert b.stop() == 0, b.tail()
        a.start()
        # A's verdict on its state dir: its gauge reads 0 from its start, before it is assigned anything.
        wait_for(lambda: "local index is stale" in a.log.read_text(), RESTART_S, "A discarding its stale index")
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 0, 30, "A serving")
        assert a.stop() == 0, a.tail()
    finally:
        a.close()
        b.close()
    assert "local index is stale" in a.log.read_text()
    assert_once_each(kafka_helper, f"{topic}.a", 200)


def test_sigterm_while_due_records_are_read_back_checkpoints_and_exits_0(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic = topic_factory("readback")
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    port, count = free_port(), 60_000
    args = run_args(kafka, policies, tmp_path / "state", port, f"g-{topic}", "--read-ahead-ms", "0")
    sidecar = SidecarProcess(args, tmp_path / "log")
    value = b"x" * 1_000
    try:
        start_serving(sidecar, port)
        # Every record must be indexed (not due at intake) to be read back: the lead covers producing
        # and taking in 60 MB, about 4 s on an idle machine, several times that on a busy one.
        due = int(time.time() * 1000) + 20_000
        for _ in range(count):
            kafka_helper.produce(topic, value, headers=[("deliver-at", str(due))])
        kafka_helper.flush()
        wait_for(lambda: scrape(port, "delay_sidecar_messages_delayed_total", topic=topic) == count, 60, "indexing")
        # Every record falls due at once and is read back in one long pass: stop in the middle of it.
        time.sleep(max(due + 300 - time.time() * 1000, 0) / 1000)
        assert sidecar.stop() == 0, sidecar.tail()
        sidecar.start()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= count, 60, "the rest")
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 0, 30, "a checkpoint")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", count)


def test_the_commit_never_passes_what_a_degraded_index_made_durable(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile
) -> None:
    topic, group = topic_factory("degraded"), f"g-{uuid.uuid4().hex[:8]}"

    def committed_offsets() -> list[int]:
        return [offset for offset, _ in committed(kafka, group, topic, 1)]

    storage = FakeSnapshotStorage()
    trackers: dict[str, BucketTracker] = {}

    def factory(name: str, partition: int) -> Any:
        if name != topic:
            return InMemoryTracker(SystemClock())
        trackers[name] = BucketTracker(SystemClock(), storage, f"{name}/{partition}")
        return trackers[name]

    policies = load_policies(policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n"))
    sidecar = Sidecar({"bootstrap.servers": kafka}, lambda: policies, factory, group_id=group, commit_interval_ms=100)
    thread = threading.Thread(target=sidecar.run, daemon=True)
    thread.start()
    try:
        assert sidecar.assigned.wait(30)
        produce_due(kafka_helper, topic, [int(time.time() * 1000) + 600_000] * 50)
        wait_for(lambda: committed_offsets() == [50], 30, "the first commit")
        # Attempts counted from here: the successful checkpoints before it are in `calls` too, and a
        # count that included them was reached by the first failing attempt, before its retries had
        # marked the tracker degraded (a chance failure of the fresh-clone CI).
        before = storage.calls["checkpoint"]
        storage.fail("checkpoint", 1_000_000)
        produce_due(kafka_helper, topic, [int(time.time() * 1000) + 600_000] * 50)
        wait_for(lambda: sidecar.metrics.registry.get_sample_value(
            "delay_sidecar_messages_delayed_total", {"topic": topic}) == 100, 30, "intake")  # fmt: skip
        tracker = trackers[topic]
        wait_for(lambda: storage.calls["checkpoint"] > before + 5 and tracker.degraded, 30, "failing checkpoints")
        assert tracker.index_cursor() == 50
        assert committed_offsets() == [50]
        storage.heal()
        wait_for(lambda: committed_offsets() == [100], 30, "the commit after healing")
    finally:
        sidecar.stop()
        thread.join(30)


class GatedStorage(FakeSnapshotStorage):
    """A store whose fsync waits for the test: a disk that is slow to answer."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.waiting_since: float | None = None

    def sync(self) -> None:
        if not self.gate.is_set():
            self.waiting_since = time.monotonic()
            self.gate.wait(60)
        super().sync()


def test_the_commit_waits_for_the_index_fsync_while_the_loop_goes_on(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile
) -> None:
    """At least once, the checkpoint's fsync runs beside the loop: until it returns nothing is
    committed, while the loop keeps turning and delivering; a failed fsync commits nothing either."""
    topic, group = topic_factory("fsync"), f"g-{uuid.uuid4().hex[:8]}"
    outbound = f"{topic}.a"

    def committed_offsets() -> list[int]:
        return [offset for offset, _ in committed(kafka, group, topic, 1)]

    storage = GatedStorage()
    trackers: dict[str, BucketTracker] = {}

    def factory(name: str, partition: int) -> Any:
        trackers[name] = BucketTracker(SystemClock(), storage, f"{name}/{partition}")
        return trackers[name]

    policies = load_policies(policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n"))
    sidecar = Sidecar(
        {"bootstrap.servers": kafka},
        lambda: policies,
        factory,
        group_id=group,
        commit_interval_ms=100,
        index_storage=storage,
    )
    thread = threading.Thread(target=sidecar.run, daemon=True)
    thread.start()
    try:
        assert sidecar.assigned.wait(30)
        later = int(time.time() * 1000) + 600_000
        produce_due(kafka_helper, topic, [later] * 50)
        wait_for(lambda: committed_offsets() == [50], 30, "the first commit")

        storage.gate.clear()  # the disk stops answering
        produce_due(kafka_helper, topic, [later] * 25)
        wait_for(lambda: storage.waiting_since is not None, 30, "an fsync")
        # Read while that fsync waits, so no checkpoint takes them in until it returns. (CI at
        # c3c1d52: 50 records produced at once were read in two batches, the fsync began between
        # them, and a wait for the checkpoint of all 50 ran out.)
        produce_due(kafka_helper, topic, [later] * 25)
        waiting_since = storage.waiting_since
        assert waiting_since is not None
        # Several commit intervals later the loop still turns: the checkpoints wait, not the loop.
        wait_for(lambda: sidecar._turned > waiting_since + 1.0, 30, "loop turns during the fsync")
        now = int(time.time() * 1000)
        for i in range(20):
            kafka_helper.produce(topic, f"due{i}".encode(), headers=[("deliver-at", str(now))])
        kafka_helper.flush()
        wait_for(lambda: outbound_end(kafka_helper, outbound) == 20, 30, "deliveries during the fsync")
        assert not storage.gate.is_set() and committed_offsets() == [50]
        storage.gate.set()
        wait_for(lambda: committed_offsets() == [120], 30, "the commit after the fsync")

        storage.fail("sync", 1_000_000)
        produce_due(kafka_helper, topic, [later] * 10)
        sync_failures = {"type": "sync", "state": "failed"}
        wait_for(lambda: (sidecar.metrics.registry.get_sample_value(
            "delay_sidecar_bucket_op_total", sync_failures) or 0) > 3 and trackers[topic].index_cursor() == 130,
            30, "failing fsyncs after the last records were checkpointed")  # fmt: skip
        assert committed_offsets() == [120]
        storage.heal()
        wait_for(lambda: committed_offsets() == [130], 30, "the commit after healing")
    finally:
        storage.gate.set()
        sidecar.stop()
        thread.join(30)
    assert_once_each(kafka_helper, outbound, 20)


@pytest.mark.parametrize("lost", ["kill -9", "state dir deleted"])
def test_rebuild_skips_what_the_watermark_covers(
    lost: str,
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: TopicFactory,
    policy_file: PolicyFile,
    tmp_path: Path,
) -> None:
    """Records delivered before the index was lost are not delivered again by its rebuild."""
    topic = topic_factory("watermark")
    policies = policy_file(f"topics:\n  {topic}:\n    subscriptions: {{a: {{}}}}\n")
    port, state = free_port(), tmp_path / "state"
    tracker = ["--tracker", "memory"] if lost == "kill -9" else []
    sidecar = SidecarProcess(run_args(kafka, policies, state, port, f"g-{topic}", *tracker), tmp_path / "log")
    try:
        start_serving(sidecar, port)
        now = int(time.time() * 1000)
        produce_due(kafka_helper, topic, [now + (2_000 if i % 2 == 0 else 10_000) for i in range(1_000)])
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") == 500, 60, "the early half")
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=topic) == 500, 30, "a checkpoint")
        # The gauge is set before the commit (it waits for the fsync): a kill and a lost state dir in between redeliver.
        last_early = pack(now + 2_000, 998)
        through = lambda: CommitMetadata.decode(committed(kafka, f"g-{topic}", topic, 1)[0][1]).through  # noqa: E731
        wait_for(lambda: through() >= last_early, 60, "a commit whose watermark covers the early half")
        sidecar.kill()
        if lost == "state dir deleted":
            shutil.rmtree(state)
        sidecar.start()
        wait_for(lambda: outbound_end(kafka_helper, f"{topic}.a") >= 1_000, 60, "the late half")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    assert_once_each(kafka_helper, f"{topic}.a", 1_000)
