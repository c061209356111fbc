"""The log reader against a real broker: it assigns the partitions of each read afresh and gives
them up when they are read, also after a read was interrupted."""

import threading

from sidecar.dispatch.reader import LogReader, ReadInterrupted
from tests.kafka_helpers import KafkaHelper, TopicFactory


def test_reads_go_on_after_a_read_was_interrupted(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory
) -> None:
    topic = topic_factory("reader", partitions=2)
    for i in range(50):
        kafka_helper.produce(topic, f"v{i}".encode(), partition=0)
        kafka_helper.produce(topic, f"w{i}".encode(), partition=1)
    kafka_helper.flush()
    stop = threading.Event()
    reader = LogReader({"bootstrap.servers": kafka}, stop)
    try:
        first = [(o, r.value()) for _, o, r in reader.read({(topic, 0): [3, 10]}) if r is not None]
        assert first == [(3, b"v3"), (10, b"v10")]
        later = [o for _, o, _ in reader.read({(topic, 0): [20, 21]})]
        assert later == [20, 21]
        stop.set()
        try:
            list(reader.read({(topic, 1): [30]}))
            raise AssertionError("a read with the stop set must be interrupted")
        except ReadInterrupted:
            pass
        stop.clear()
        # The interrupted read dropped every partition: the next read assigns partition 0 again.
        again = [(o, r.value()) for _, o, r in reader.read({(topic, 0): [5, 40]}) if r is not None]
        assert again == [(5, b"v5"), (40, b"v40")]
    finally:
        reader.close()


def test_a_reader_holds_no_partition_between_reads(
    kafka: str, kafka_helper: KafkaHelper, topic_factory: TopicFactory
) -> None:
    """A partition kept paused between reads waited 0.8 to 1 s for its first record at the next one
    (librdkafka does not wake its fetcher on a resume, nor on a seek to offset 0 after one): every
    read assigns its partitions afresh, and gives them up once it has their offsets."""
    topic = topic_factory("reader-fresh", partitions=2)
    for i in range(20):
        kafka_helper.produce(topic, f"v{i}".encode(), partition=i % 2)
    kafka_helper.flush()
    reader = LogReader({"bootstrap.servers": kafka}, threading.Event())
    try:
        for wanted in ({(topic, 0): [2, 5]}, {(topic, 0): [0, 9], (topic, 1): [1]}, {(topic, 1): [0]}):
            got = {(p, o): r.value() for p, o, r in reader.read(wanted) if r is not None}
            assert sorted(got) == sorted((p, o) for p, offsets in wanted.items() for o in offsets)
            assert reader._consumer.assignment() == []
    finally:
        reader.close()
