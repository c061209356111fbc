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
    kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    """KIP-447 on a consume-transform-produce loop: two members of one group, each with a
    transactional producer of its own (transactional.ids are no longer tied to partitions). After a
    rebalance, the older member's producer still holds the group metadata of the generation before:
    a zombie that missed the rebalance. Its offsets for a partition that moved must be refused
    (ILLEGAL_GENERATION; UNKNOWN_MEMBER_ID once the member is gone) and its transaction aborted, while
    the new owner commits the same partition with the current metadata.

    noida-db (the fallback broker) fails this test: it does not check the generation or member id
    of TxnOffsetCommit and lets the zombie commit, so the test is not part of the fallback's set.
    There the sidecar's own fencing (each commit names its producer, and a successor of the same
    identity fences it: sidecar/identity.py) is what keeps a zombie out."""
    source, out = topic_factory("kip447", partitions=2), topic_factory("kip447-out", partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    for i in range(8):
        kafka_helper.produce(source, f"v{i}".encode(), partition=i % 2)
    kafka_helper.flush()

    def transform(producer: Producer, records: list[Message], offsets: list[TopicPartition], meta: object) -> None:
        """One turn of the loop: outputs and input offsets in one transaction (not committed here)."""
        producer.begin_transaction()
        for record in records:
            producer.produce(out, b"out:" + record.value(), partition=record.partition())
        producer.send_offsets_to_transaction(offsets, meta, 30)

    first = member(kafka, group, source, None)
    second: Consumer | None = None
    first_tx = Producer({"bootstrap.servers": kafka, "transactional.id": f"tx-{uuid.uuid4().hex[:8]}"})
    second_tx = Producer({"bootstrap.servers": kafka, "transactional.id": f"tx-{uuid.uuid4().hex[:8]}"})
    try:
        # Generation 1: the first member owns both partitions and runs one turn of the loop.
        records = [m for m in poll_until(first, lambda seen: len(seen) >= 8) if m.error() is None]
        assert len(first.assignment()) == 2
        stale = first.consumer_group_metadata()
        first_tx.init_transactions(30)
        transform(first_tx, records, [TopicPartition(source, p, 4, metadata="first") for p in (0, 1)], stale)
        first_tx.commit_transaction(30)
        assert committed(kafka, group, source, 2) == [(4, "first"), (4, "first")]

        # A second member joins: a rebalance to the next generation, one partition each. Both poll,
        # so that the first rejoins (its member id stays, its generation moves on).
        second = member(kafka, group, source, None)
        deadline = time.monotonic() + 60
        while len(first.assignment()) != 1 or len(second.assignment()) != 1:
            assert time.monotonic() < deadline, (first.assignment(), second.assignment())
            first.consume(100, 0.1)
            second.consume(100, 0.1)
        moved = second.assignment()[0].partition
        kafka_helper.produce(source, b"after the rebalance", partition=moved)
        kafka_helper.flush()
        taken = [m for m in poll_until(second, lambda seen: len(seen) >= 1) if m.error() is None]
        assert [(m.partition(), m.offset()) for m in taken] == [(moved, 4)]

        # The zombie: the first producer, with the old generation's metadata, for the partition that moved.
        with pytest.raises(KafkaException) as refused:
            transform(first_tx, taken, [TopicPartition(source, moved, 5, metadata="zombie")], stale)
        error = refused.value.args[0]
        assert error.code() in (KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID), error
        assert error.txn_requires_abort(), error
        first_tx.abort_transaction(30)

        # The new owner commits the same partition with the current generation's metadata.
        second_tx.init_transactions(30)
        offsets = [TopicPartition(source, moved, 5, metadata="second")]
        transform(second_tx, taken, offsets, second.consumer_group_metadata())
        second_tx.commit_transaction(30)
        expected = [(4, "first"), (4, "first")]
        expected[moved] = (5, "second")
        assert committed(kafka, group, source, 2) == expected
        outputs = sorted(r.value or b"" for r in kafka_helper.read_to_end(out, committed_only=True))
        assert outputs == sorted([f"out:v{i}".encode() for i in range(8)] + [b"out:after the rebalance"])
    finally:
        first.close()
        if second is not None:
            second.close()


def test_a_read_committed_fetch_past_an_aborted_transaction_still_returns_later_commits(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: Callable[..., str]
) -> None:
    """A producer id's commits after its abort must reach a consumer that already read past the
    abort marker. The sidecar no longer depends on it (a new transactional.id, so a new producer
    id, after every restart: sidecar/identity.py), but Kafka's clients do.

    noida-db (the fallback broker) fails this test, so it is not part of the fallback's set: its
    fetch responses list aborted transactions that ended before the fetch offset, and librdkafka
    then drops every later batch of that producer id in the response. Apache Kafka lists only those
    overlapping the fetched range.
    """
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
