"""A topic that leaves the policies: its pending records go to its dead-letter topic with TOPIC_REMOVED.

Whether it leaves while the sidecar runs or while it is down, in either processing guarantee, with
one process or several: every record pending at the removal reaches the dead-letter topic once, no
record delivered before it does, and nothing of it reaches the outbound topics afterwards. Counted
per record, each topic read to its high watermark.
"""

import itertools
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from confluent_kafka import Producer

from sidecar.broker.ports import free_ports
from sidecar.client_cancel import Canceller, OutcomeReader
from sidecar.outbound.records import ERROR_CODE, ORIGIN_OFFSET, ORIGIN_PARTITION, ORIGIN_TOPIC
from sidecar.partitions.metadata import CommitMetadata
from sidecar.tracker.base import pack
from tests.kafka_helpers import (
    HoldableClock,
    KafkaHelper,
    Received,
    SidecarProcess,
    ThreadedSidecar,
    committed,
    deliveries,
    early,
    outbound_end,
    run_args,
    scrape,
    settings_for,
    wait_for,
)

DEADLINE_S = 60.0
OWN_DELAY_S = 2
"""The own delay of the records that are rescheduled before their time: the sidecar's clock is held
until the reschedules are answered (a broker that stalled 30 s on a loaded machine once let the time
of records with 15 s pass first: `too-late`)."""
REJECTED = "delay_sidecar_messages_delayed_rejected_total"


def policy(*topics: str) -> str:
    return "topics:\n" + "".join(f"  {topic}:\n    subscriptions: {{a: {{}}}}\n" for topic in topics)


def origins(records: list[Received]) -> Counter[tuple[int, int]]:
    return Counter((int(r.headers[ORIGIN_PARTITION]), int(r.headers[ORIGIN_OFFSET])) for r in records)


def produce(kafka_helper: KafkaHelper, topic: str, partitions: int, per_partition: list[str | None]) -> None:
    """One record per entry on each partition: entry None carries no delay header, else deliver-after."""
    for partition in range(partitions):
        for i, delay in enumerate(per_partition):
            headers = [("deliver-after", delay)] if delay is not None else []
            kafka_helper.produce(topic, f"{partition}-{i}".encode(), headers=headers, partition=partition)
    kafka_helper.flush()


def earliest_pending(kafka: str, group: str, topic: str, partitions: int) -> list[int | None]:
    """Per partition, the earliest pending offset the group's commit records."""
    return [CommitMetadata.decode(metadata).earliest for _, metadata in committed(kafka, group, topic, partitions)]


def nothing_pending(kafka: str, group: str, topic: str, partitions: int) -> bool:
    for offset, metadata in committed(kafka, group, topic, partitions):
        earliest = CommitMetadata.decode(metadata).earliest
        if offset >= 0 and earliest is not None and earliest < offset:
            return False
    return True


@pytest.mark.parametrize(
    ("fault", "guarantee", "workers"),
    [("kill -9", "at-least-once", "1"), ("SIGTERM", "exactly-once", "2")],
)
def test_a_topic_removed_while_the_sidecar_is_down_dead_letters_its_pending_records_at_the_restart(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
    fault: str,
    guarantee: str,
    workers: str,
) -> None:
    partitions = 3
    removed, kept = topic_factory("gone", partitions=partitions), topic_factory("kept", partitions=partitions)
    path = policy_file(policy(removed, kept))
    group = f"g-{removed}"
    port = free_ports(3)
    args = run_args(kafka, path, tmp_path / "state", port, group, "--processing-guarantee", guarantee,
                    "--workers", workers)  # fmt: skip
    sidecar = SidecarProcess(args, tmp_path / "log")
    exact = guarantee == "exactly-once"
    # Per partition: 20 records without delay, 30 delivered before the fault, 50 pending at it.
    shape: list[str | None] = [None] * 20 + ["1s"] * 30 + ["10m"] * 50
    try:
        sidecar.start()
        produce(kafka_helper, removed, partitions, shape)
        produce(kafka_helper, kept, partitions, ["8s"] * 40)  # due after the restart
        wait_for(lambda: outbound_end(kafka_helper, f"{removed}.a", partitions) >= 150, DEADLINE_S, "the first 150")
        # Committed: every record read, and the first 50 of each partition delivered (the rest pending).
        wait_for(lambda: [o for o, _ in committed(kafka, group, removed, partitions)] == [100] * partitions,
                 DEADLINE_S, "the commit of every record")  # fmt: skip
        wait_for(lambda: earliest_pending(kafka, group, removed, partitions) == [50] * partitions, DEADLINE_S,
                 "the commit of the deliveries")  # fmt: skip
        if fault == "kill -9":
            sidecar.kill()
        else:
            assert sidecar.stop() == 0, sidecar.tail()
        path.write_text(policy(kept))
        produce(kafka_helper, removed, partitions, ["1s"] * 5)  # after the removal: neither delivered nor dead
        sidecar.start()
        wait_for(lambda: outbound_end(kafka_helper, f"{removed}.dlt", partitions) >= 150, DEADLINE_S, "dead letters")
        wait_for(lambda: nothing_pending(kafka, group, removed, partitions), DEADLINE_S, "a commit with none pending")
        wait_for(lambda: outbound_end(kafka_helper, f"{kept}.a", partitions) >= 120, DEADLINE_S, "the kept topic")
        # The check for a drained topic runs every few seconds, in each worker: wait for it, don't race it.
        wait_for(lambda: "drained in the whole group; unsubscribing" in sidecar.log.read_text(), DEADLINE_S,
                 "the unsubscribe of the drained topic")  # fmt: skip
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    dead = kafka_helper.read_to_end(f"{removed}.dlt", committed_only=exact)
    pending = {(p, o) for p in range(partitions) for o in range(50, 100)}
    assert origins(dead) == Counter(pending), sidecar.tail()
    assert {r.headers[ERROR_CODE] for r in dead} == {b"TOPIC_REMOVED"}
    assert {r.headers[ORIGIN_TOPIC] for r in dead} == {removed.encode()}
    delivered = kafka_helper.read_to_end(f"{removed}.a", committed_only=exact)
    assert origins(delivered) == Counter({(p, o) for p in range(partitions) for o in range(50)})
    # The committed offsets stay where the removal left them: the later records are the topic's own.
    assert [o for o, _ in committed(kafka, group, removed, partitions)] == [100] * partitions
    kept_records = kafka_helper.read_to_end(f"{kept}.a", committed_only=exact)
    assert sorted(deliveries(kept_records).values()) == [1] * 120


def test_a_topic_removed_live_keeps_the_other_topics_delivering_while_it_drains(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    """The drain takes a slice per loop turn: the kept topic's records due meanwhile go out meanwhile."""
    removed, kept = topic_factory("drained"), topic_factory("busy")
    path = policy_file(policy(removed, kept))
    pending = 60_000
    with ThreadedSidecar(settings_for(kafka, path, tmp_path)) as sidecar:
        produce(kafka_helper, removed, 1, ["10m"] * pending)
        sidecar.wait_for_metric("delay_sidecar_messages_delayed_total", pending, DEADLINE_S, topic=removed)
        now = int(time.time() * 1000)
        # One every 3 ms for 30 s, so records still fall due whenever the drain runs: over 5 s, a CI
        # run's reload came after 6,788 of 10,000 and the drain saw none go out between its looks.
        due = [now + 2_000 + i * 3 for i in range(10_000)]
        for i, at in enumerate(due):
            kafka_helper.produce(kept, f"k{i}".encode(), headers=[("deliver-at", str(at))])
        kafka_helper.flush()
        sidecar.wait_for_metric("delay_sidecar_messages_delivered_total", 1, DEADLINE_S, topic=kept, subscription="a")
        path.write_text(policy(kept))
        # Exported when the drain starts: missing after that is a failure, not a zero.
        sidecar.wait_for_metric(REJECTED, 0, DEADLINE_S, topic=removed, namespace="", code="TOPIC_REMOVED")

        def dead() -> float:
            return sidecar.metric(REJECTED, topic=removed, namespace="", code="TOPIC_REMOVED")

        def delivered() -> float:
            return sidecar.metric("delay_sidecar_messages_delivered_total", topic=kept, subscription="a")

        # Two looks, both while the drain is part-way, between which the kept topic delivered.
        seen: list[tuple[float, float]] = []
        deadline = time.monotonic() + DEADLINE_S
        while dead() < pending and time.monotonic() < deadline:
            look = (dead(), delivered())
            if 0 < look[0] < pending:
                seen.append(look)
            time.sleep(0.005)
        # No fault in this run, so no engine restart and no repeat: a broker that is slow to answer
        # a commit or to acknowledge puts a checkpoint off instead (CI once repeated 561 dead letters
        # after a NOT_COORDINATOR restarted the engine).
        assert sidecar.metric("delay_sidecar_engine_restarts_total") == 0, "an engine restart without a fault"
        assert dead() == pending
        interleaved = any(a[1] < b[1] and a[0] < b[0] for a, b in itertools.pairwise(seen))
        assert interleaved, f"no delivery of the kept topic was seen while the drain was part-way: {seen[:10]}"
        wait_for(lambda: outbound_end(kafka_helper, f"{kept}.a") >= len(due), DEADLINE_S, "the kept topic")
        every = Counter({(0, o) for o in range(pending)})
        wait_for(lambda: origins(kafka_helper.read_to_end(f"{removed}.dlt")).keys() == every.keys(), DEADLINE_S,
                 "every pending record dead-lettered")  # fmt: skip
    dead_letters = kafka_helper.read_to_end(f"{removed}.dlt")
    assert origins(dead_letters) == every
    assert {r.headers[ERROR_CODE] for r in dead_letters} == {b"TOPIC_REMOVED"}
    assert kafka_helper.read_to_end(f"{removed}.a") == []
    assert sorted(deliveries(kafka_helper.read_to_end(f"{kept}.a")).values()) == [1] * len(due)


def test_a_topic_back_in_the_policies_mid_drain_delivers_what_was_not_dead_lettered(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    """Removed, then added back part-way through the drain: the drain stops where it is. Each pending
    record is either dead-lettered or delivered, once: the drain's, in offset order, up to where it
    stopped; the rest delivered at their time."""
    topic = topic_factory("back")
    path = policy_file(policy(topic))
    pending = 40_000
    with ThreadedSidecar(settings_for(kafka, path, tmp_path)) as sidecar:
        # Due well after the removal: a record delivered before it is not pending, and with none pending
        # there is no drain to interrupt. Under the full suite's load, producing and indexing these
        # took 4.7 s, and with 5 s here they were delivered before the drain began.
        soon = int(time.time() * 1000) + 20_000
        for i in range(pending):
            kafka_helper.produce(topic, f"v{i}".encode(), headers=[("deliver-at", str(soon))])
        kafka_helper.flush()
        sidecar.wait_for_metric("delay_sidecar_messages_delayed_total", pending, DEADLINE_S, topic=topic)
        path.write_text("allow_empty: true\ntopics: {}\n")
        sidecar.app.reload_policies()
        sidecar.wait_for_metric(REJECTED, 0, DEADLINE_S, topic=topic, namespace="", code="TOPIC_REMOVED")
        deadline = time.monotonic() + DEADLINE_S
        while sidecar.metric(REJECTED, topic=topic, namespace="", code="TOPIC_REMOVED") == 0:
            assert time.monotonic() < deadline, "the drain did not start"
            time.sleep(0.005)
        under_way = sidecar.metric(REJECTED, topic=topic, namespace="", code="TOPIC_REMOVED")
        path.write_text(policy(topic))  # part-way through the drain
        # Loaded now, not once the file has settled (a second and more, about the whole drain's time):
        # the loop's next turn serves the topic again.
        assert sidecar.app.policies is not None
        assert sidecar.app.policies.reload_now().ok
        wait_for(
            lambda: outbound_end(kafka_helper, f"{topic}.dlt") + outbound_end(kafka_helper, f"{topic}.a") >= pending,
            DEADLINE_S,
            "every record, dead or delivered",
        )
    dead = origins(kafka_helper.read_to_end(f"{topic}.dlt"))
    records = kafka_helper.read_to_end(f"{topic}.a")
    delivered = origins(records)
    stopped = len(dead)
    print(f"re-added mid-drain: {under_way:.0f} dead letters counted then, {stopped} in all, {len(delivered)} later")
    assert 0 < under_way < pending, "the topic did not come back mid-drain"
    assert under_way <= stopped < pending, "the drain did not stop where the topic came back"
    assert dead == Counter({(0, o): 1 for o in range(stopped)}), "dead-lettered: offset order, once each"
    assert delivered == Counter({(0, o): 1 for o in range(stopped, pending)}), "delivered: the rest, once each"
    assert not early(records)


def test_a_kill_9_mid_drain_dead_letters_each_pending_record_once_in_exactly_once_mode(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    """The drain's progress is committed with the dead letters that made it: a restart resumes there,
    so a record dead-lettered before the kill (committed) is not dead-lettered again."""
    removed, kept = topic_factory("cut"), topic_factory("stays")
    path = policy_file(policy(removed, kept))
    group = f"g-{removed}"
    port = free_ports(1)
    args = run_args(kafka, path, tmp_path / "state", port, group, "--processing-guarantee", "exactly-once")
    sidecar = SidecarProcess(args, tmp_path / "log")
    pending = 40_000
    try:
        sidecar.start()
        produce(kafka_helper, removed, 1, ["10m"] * pending)
        wait_for(lambda: scrape(port, "delay_sidecar_tracked_messages", topic=removed) == pending, DEADLINE_S,
                 "indexed")  # fmt: skip
        path.write_text(policy(kept))

        def dead() -> float:
            return scrape(port, REJECTED, topic=removed, namespace="", code="TOPIC_REMOVED")

        wait_for(lambda: dead() >= 0, DEADLINE_S, "the drain started")  # exported from its start on

        # Killed once a commit has recorded some progress (its earliest pending offset, past the
        # dead letters committed with it) and the drain is still under way.
        progress: list[int | None] = [None]
        deadline = time.monotonic() + DEADLINE_S
        while not ((progress[0] or 0) > 0 and dead() < pending) and time.monotonic() < deadline:
            progress = earliest_pending(kafka, group, removed, 1)
            time.sleep(0.005)
        resumable = progress[0] or 0
        assert 0 < resumable < pending, f"no drain progress committed part-way: {progress}"
        sidecar.kill()
        restarted = len(sidecar.log.read_text())
        sidecar.start()
        wait_for(lambda: nothing_pending(kafka, group, removed, 1), DEADLINE_S, "a commit with none pending")
        assert sidecar.stop() == 0, sidecar.tail()
    finally:
        sidecar.close()
    resumed = re.findall(r"dead-lettering the pending records of a removed topic\W.*? from=(\d+)",
                         sidecar.log.read_text()[restarted:])  # fmt: skip
    assert resumed and int(resumed[0]) >= resumable, (resumed, resumable)
    dead_letters = kafka_helper.read_to_end(f"{removed}.dlt", committed_only=True)
    assert origins(dead_letters) == Counter({(0, o) for o in range(pending)}), sidecar.tail()
    assert kafka_helper.read_to_end(f"{removed}.a", committed_only=True) == []


@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_a_drain_leaves_out_what_cancels_took_back_and_dead_letters_what_reschedules_still_owe(
    kafka: str,
    kafka_helper: KafkaHelper,
    topic_factory: Callable[..., str],
    policy_file: Callable[[str], Path],
    tmp_path: Path,
    guarantee: str,
) -> None:
    """One fate a record: a record cancelled before its topic was removed is not dead-lettered
    afterwards, nor one whose reschedule delivered it; one still owed to some subscription is, once,
    even when only a reschedule's copy still owes it (its own time long past). Before, the drain
    judged every record again by its own deliver-at and knew nothing of cancels and reschedules: it
    dead-lettered the cancelled and the delivered, and lost the record whose copy was pending."""
    removed, kept, control = topic_factory("cancelled"), topic_factory("kept"), f"ctl-{uuid.uuid4().hex[:8]}"
    two = "  {t}:\n    subscriptions: {{a: {{}}, b: {{}}}}\n"
    path = policy_file("topics:\n" + two.format(t=removed) + two.format(t=kept))
    settings = settings_for(kafka, path, tmp_path, control_topic=control, processing_guarantee=guarantee)
    produce(kafka_helper, removed, 1, ["10m"] * 40)
    clock = HoldableClock()
    with ThreadedSidecar(settings, clock) as sidecar, OutcomeReader({"bootstrap.servers": kafka}, control) as reader:
        sidecar.wait_for_metric("delay_sidecar_messages_delayed_total", 40, DEADLINE_S, topic=removed)
        canceller = Canceller(Producer({"bootstrap.servers": kafka}), control)
        # 40-44 are rescheduled before their own time, which then passes: pending as copies only.
        # The sidecar's clock stands still until every command is answered, so no load can let
        # their time pass before their reschedules are read.
        with clock.held():
            produce(kafka_helper, removed, 1, [f"{OWN_DELAY_S}s"] * 5)
            sidecar.wait_for_metric("delay_sidecar_messages_delayed_total", 45, DEADLINE_S, topic=removed)
            ids = [canceller.reschedule(f"{removed}/0/{o}", timedelta(minutes=20)) for o in range(40, 45)]
            ids += [canceller.cancel(f"{removed}/0/{o}") for o in range(10)]  # taken back from both
            ids += [canceller.cancel(f"{removed}/0/{o}", subscription="a") for o in range(10, 15)]  # still b's
            ids += [canceller.reschedule(f"{removed}/0/{o}", timedelta(seconds=1)) for o in range(15, 20)]  # delivered
            ids += [canceller.reschedule(f"{removed}/0/{o}", timedelta(minutes=20)) for o in range(20, 25)]  # pending
            canceller.flush(10)
            answers = reader.wait(ids, timeout_s=DEADLINE_S)
        assert sorted(a.outcome for a in answers.values()) == ["cancelled"] * 15 + ["rescheduled"] * 15
        wait_for(lambda: outbound_end(kafka_helper, f"{removed}.a") + outbound_end(kafka_helper, f"{removed}.b") >= 10,
                 DEADLINE_S, "the five rescheduled to 1 s delivered to both")  # fmt: skip
        # 40-44 came out of the index at their own time, to nobody, and a commit says so: only
        # their copies are still pending.
        last = kafka_helper.read_to_end(removed)[44]
        popped = pack(last.timestamp + OWN_DELAY_S * 1_000, 44)
        wait_for(lambda: (CommitMetadata.decode(committed(kafka, settings.group_id, removed, 1)[0][1]).through or 0)
                 >= popped, DEADLINE_S, "the originals of 40-44 out of the index")  # fmt: skip
        path.write_text(policy(kept))
        wait_for(
            lambda: nothing_pending(kafka, settings.group_id, removed, 1), DEADLINE_S, "a commit with none pending"
        )
    exact = guarantee == "exactly-once"
    owed = Counter({(0, o) for o in [*range(10, 15), *range(20, 40), *range(40, 45)]})
    assert origins(kafka_helper.read_to_end(f"{removed}.dlt", committed_only=exact)) == owed
    delivered = [r for sub in "ab" for r in kafka_helper.read_to_end(f"{removed}.{sub}", committed_only=exact)]
    assert origins(delivered) == Counter({(0, o): 2 for o in range(15, 20)})
