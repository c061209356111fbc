"""What exactly-once rests on, checked on the broker the tests run against (issue 14's first step)."""

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from tests.kafka_helpers import KafkaHelper, committed


def test_a_second_producer_with_the_same_transactional_id_fences_the_first(
    kafka: str, topic_factory: Callable[..., str]
) -> None:
    topic, transactional_id = topic_factory("fence"), f"tx-{uuid.uuid4().hex[:8]}"
    zombie = Producer({"bootstrap.servers": kafka, "transactional.id": transactional_id})
    zombie.init_transactions(30)
    zombie.begin_transaction()
    zombie.produce(topic, b"from the zombie")
    successor = Producer({"bootstrap.servers": kafka, "transactional.id": transactional_id})
    successor.init_transactions(30)
    with pytest.raises(KafkaException) as failed:
        zombie.commit_transaction(30)
    assert failed.value.args[0].code() == KafkaError._FENCED


def member(kafka: str, group: str, topic: str, instance: str | None) -> Consumer:
    static = {"group.instance.id": instance} if instance else {}
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": group, "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", **static})  # fmt: skip
    consumer.subscribe([topic])
    return consumer


def poll_until(consumer: Consumer, done: Callable[[list[Message]], bool], timeout_s: float = 30) -> list[Message]:
    seen: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while not done(seen):
        assert time.monotonic() < deadline, f"gave up after {len(seen)} records"
        seen += consumer.consume(100, 0.2)
    return seen


def test_offsets_sent_to_a_transaction_keep_their_metadata_and_commit_only_with_it(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    topic, out, group = topic_factory("in"), topic_factory("out"), f"g-{uuid.uuid4().hex[:8]}"
    for i in range(10):
        kafka_helper.produce(topic, f"v{i}".encode())
    kafka_helper.flush()
    consumer = member(kafka, group, topic, "m1")
    producer = Producer({"bootstrap.servers": kafka, "transactional.id": f"tx-{uuid.uuid4().hex[:8]}"})
    try:
        poll_until(consumer, lambda seen: len(seen) >= 10)
        producer.init_transactions(30)
        meta = '{"v":2,"earliest":3,"through":[1795000000000,2]}'
        for offset, metadata, commit in ((5, meta, True), (8, "aborted", False)):
            producer.begin_transaction()
            producer.produce(out, metadata.encode())
            offsets = [TopicPartition(topic, 0, offset, metadata=metadata)]
            producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
            if commit:
                producer.commit_transaction(30)
            else:
                producer.abort_transaction(30)
        assert committed(kafka, group, topic, 1) == [(5, meta)]
        assert [r.value for r in kafka_helper.read_to_end(out, committed_only=True)] == [meta.encode()]
    finally:
        consumer.close()


def test_a_second_static_member_with_the_same_instance_id_fences_the_first(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    topic, group = topic_factory("static"), f"g-{uuid.uuid4().hex[:8]}"
    kafka_helper.produce(topic, b"v")
    kafka_helper.flush()
    first = member(kafka, group, topic, "same")
    poll_until(first, lambda seen: bool(first.assignment()))
    second = member(kafka, group, topic, "same")
    try:
        poll_until(second, lambda seen: bool(second.assignment()))
        seen = poll_until(first, lambda seen: any(m.error() is not None for m in seen))
        errors = [m.error() for m in seen if m.error() is not None]
        assert errors[0].code() == KafkaError._FATAL and "fenced" in errors[0].str().lower(), errors
    finally:
        second.close()


def test_a_zombie_with_stale_group_metadata_cannot_commit_offsets(
    embedded_broker: bool, kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    """KIP-447: the consumer group metadata sent with the offsets fences a zombie whose partitions
    moved to another member (another transactional.id). NEEDS REAL KAFKA: noida-db does not check
    the generation or member id of TxnOffsetCommit and lets the zombie commit. The sidecar's own
    fencing (one transactional.id per instance id) does not rest on it; see README, exactly once."""
    if embedded_broker:
        pytest.skip("noida-db accepts TxnOffsetCommit from a stale member (no KIP-447 fencing); needs real Kafka")
    topic, group = topic_factory("kip447"), f"g-{uuid.uuid4().hex[:8]}"
    kafka_helper.produce(topic, b"v")
    kafka_helper.flush()
    first = member(kafka, group, topic, None)
    poll_until(first, lambda seen: bool(first.assignment()))
    stale = first.consumer_group_metadata()
    first.close()  # leaves the group: its member id and generation are over
    second = member(kafka, group, topic, None)
    zombie = Producer({"bootstrap.servers": kafka, "transactional.id": f"tx-{uuid.uuid4().hex[:8]}"})
    try:
        poll_until(second, lambda seen: bool(second.assignment()))
        zombie.init_transactions(30)
        zombie.begin_transaction()
        with pytest.raises(KafkaException):
            zombie.send_offsets_to_transaction([TopicPartition(topic, 0, 1, metadata="zombie")], stale, 30)
            zombie.commit_transaction(30)
    finally:
        second.close()


def test_a_read_committed_fetch_past_an_aborted_transaction_still_returns_later_commits(
    embedded_broker: bool, kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    """After a crash, the sidecar's next producer has the same transactional.id, so the same
    producer id: its commits must reach a consumer that already read past the abort marker.

    KNOWN NOIDA-DB DEFECT (xfail on the embedded broker): its fetch responses list aborted
    transactions that ended before the fetch offset, and librdkafka then drops every later batch
    of that producer id in the response. Real Kafka lists only those overlapping the fetched range.
    """
    if embedded_broker:
        pytest.xfail("noida-db lists aborted transactions that ended before the fetch offset")
    topic = topic_factory("aborted")
    producer = Producer({"bootstrap.servers": kafka, "transactional.id": f"tx-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    for value, commit in ((b"committed 1", True), (b"aborted", False), (b"committed 2", True)):
        producer.begin_transaction()
        producer.produce(topic, value)
        producer.flush(30)
        producer.commit_transaction(30) if commit else producer.abort_transaction(30)
    # Offsets: 0 record, 1 commit marker, 2 aborted record, 3 abort marker, 4 record, 5 marker.
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": f"g-{uuid.uuid4().hex[:8]}",
                         "isolation.level": "read_committed", "enable.partition.eof": True})  # fmt: skip
    consumer.assign([TopicPartition(topic, 0, 4)])
    try:
        seen = poll_until(consumer, lambda seen: any(m.error() is not None for m in seen))
        assert [m.value() for m in seen if m.error() is None] == [b"committed 2"]
    finally:
        consumer.close()
