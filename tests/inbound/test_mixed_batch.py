"""One consumed batch with every kind of record: the fates of the batch path, counted per record.

The records are produced before the sidecar starts, so its first poll takes them all in one batch
(and one slice per partition): immediate, delayed, due already, invalid, over the maximum,
miscased, and malformed control commands, interleaved. The sidecar's clock is held back until that
batch is in, so the delayed ones are not due yet when it reads them, however slowly it starts.
"""

import time
from collections import Counter
from pathlib import Path

from sidecar.outbound.records import DELIVER_AT, ERROR_CODE, ORIGIN_OFFSET, ORIGIN_PARTITION
from tests.kafka_helpers import (
    KafkaHelper,
    PolicyFile,
    Received,
    ThreadedSidecar,
    TopicFactory,
    deliveries,
    settings_for,
    wait_for,
)

KINDS = ["now", "delayed", "past", "invalid", "over-max", "miscased"]
EACH = 25
PARTITIONS = 2


class HeldClock:
    """The wall clock, but no later than `until` while that is set: the sidecar judges the batch as
    if it read it within a second of the publish."""

    def __init__(self, until: int) -> None:
        self.until: int | None = until

    def now_ms(self) -> int:
        now = time.time_ns() // 1_000_000
        return now if self.until is None else min(now, self.until)


def headers_of(kind: str, published: int) -> list[tuple[str, str]]:
    return {
        "now": [],
        "delayed": [("deliver-after", "3s")],
        "past": [("deliver-at", str(published - 60_000))],
        "invalid": [("deliver-after", "soon")],
        "over-max": [("deliver-after", "1h")],
        "miscased": [("Deliver-After", "3s")],
    }[kind]


def test_a_mixed_batch_gives_each_record_its_fate_once(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory, policy_file: PolicyFile, tmp_path: Path
) -> None:
    topic = topic_factory("mixed", partitions=PARTITIONS)
    control = topic_factory("mixedctl")
    policies = policy_file(f"""
topics:
  {topic}:
    delayed_delivery: {{max_delivery_delay: 10m}}
    subscriptions: {{shared: {{}}, excl: {{type: exclusive}}}}
""")
    published = int(time.time() * 1000)
    kind_of: dict[tuple[int, int], str] = {}
    for i in range(EACH * len(KINDS)):
        kind, partition = KINDS[i % len(KINDS)], i % PARTITIONS
        kind_of[(partition, i // PARTITIONS)] = kind
        kafka_helper.produce(topic, f"v{i}".encode(), headers=headers_of(kind, published), partition=partition,
                             timestamp=published)  # fmt: skip
        if i % 50 == 0:
            kafka_helper.produce(control, b"{not json", partition=0)
    kafka_helper.flush()
    malformed = len(range(0, EACH * len(KINDS), 50))
    expect = Counter(kind_of.values())
    dead_kinds = {"invalid", "over-max"}
    shared_kinds = {"now", "delayed", "past", "miscased"}
    settings = settings_for(kafka, policies, tmp_path, control_topic=control)
    clock = HeldClock(published + 1_000)  # the delayed kind is due at published + 3 s
    sidecar = ThreadedSidecar(settings)
    sidecar.app.clock = clock  # read when the app runs
    with sidecar:
        wait_for(lambda: sidecar.metric("delay_sidecar_messages_in_total", topic=topic) == len(kind_of), 60, "intake")
        clock.until = None
        n_shared = sum(expect[k] for k in shared_kinds)
        n_excl = n_shared
        n_dead = sum(expect[k] for k in dead_kinds)
        wait_for(lambda: len(kafka_helper.read_to_end(f"{topic}.shared")) >= n_shared, 60, "the shared deliveries")
        wait_for(lambda: len(kafka_helper.read_to_end(f"{control}.dlt")) >= malformed, 60, "the refused commands")
        shared = kafka_helper.read_to_end(f"{topic}.shared")
        excl = kafka_helper.read_to_end(f"{topic}.excl")
        dead = kafka_helper.read_to_end(f"{topic}.dlt")
        refused = kafka_helper.read_to_end(f"{control}.dlt")
        assert sidecar.metric("delay_sidecar_messages_in_total", topic=topic) == len(kind_of)
        assert sidecar.metric("delay_sidecar_messages_delayed_total", topic=topic) == expect["delayed"]
        assert sidecar.metric("delay_sidecar_delay_header_miscased_total", topic=topic) == expect["miscased"]
        for code, kind in (("INVALID_DELAY_HEADER", "invalid"), ("EXCEEDS_MAX_DELAY", "over-max")):
            assert sidecar.metric("delay_sidecar_messages_delayed_rejected_total", topic=topic, namespace="",
                                  code=code) == expect[kind]  # fmt: skip
        assert sidecar.metric("delay_sidecar_messages_delivered_total", topic=topic, subscription="shared") == n_shared
        assert sidecar.metric("delay_sidecar_messages_delivered_total", topic=topic, subscription="excl") == n_excl

    def fates(records: list[Received]) -> Counter[str]:
        return Counter(kind_of[(int(r.headers[ORIGIN_PARTITION]), int(r.headers[ORIGIN_OFFSET]))] for r in records)

    assert sorted(deliveries(shared).values()) == [1] * n_shared  # once each
    assert fates(shared) == Counter({k: expect[k] for k in shared_kinds})
    assert fates(excl) == Counter({k: expect[k] for k in shared_kinds})
    assert fates(dead) == Counter({k: expect[k] for k in dead_kinds}) and len(dead) == n_dead
    assert Counter(r.headers[ERROR_CODE] for r in dead) == {
        b"INVALID_DELAY_HEADER": expect["invalid"],
        b"EXCEEDS_MAX_DELAY": expect["over-max"],
    }
    assert len(refused) == malformed
    for r in shared:
        kind = kind_of[(int(r.headers[ORIGIN_PARTITION]), int(r.headers[ORIGIN_OFFSET]))]
        at = r.header_int(DELIVER_AT)
        assert r.timestamp >= at, "early"
        assert at == (published + 3_000 if kind == "delayed" else published)  # a past deliver-at: the publish time
    for partition in range(PARTITIONS):
        offsets = [int(r.headers[ORIGIN_OFFSET]) for r in excl if r.partition == partition]
        assert offsets == sorted(offsets) and all(r.header_int(DELIVER_AT) == published for r in excl)
