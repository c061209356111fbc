"""The log reader against a real broker: it keeps its partitions between reads, and must never
come back to one that librdkafka still holds paused."""

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
        later = [o for _, o, _ in reader.read({(topic, 0): [20, 21]})]  # read on from where it stopped
        assert later == [20, 21]
        stop.set()
        try:
            list(reader.read({(topic, 1): [30]}))  # partition 0 stays paused meanwhile
            raise AssertionError("a read with the stop set must be interrupted")
        except ReadInterrupted:
            pass
        stop.clear()
        # The interrupted read dropped every partition, partition 0 while paused: it is assigned again.
        again = [(o, r.value()) for _, o, r in reader.read({(topic, 0): [5, 40]}) if r is not None]
        assert again == [(5, b"v5"), (40, b"v40")]
    finally:
        reader.close()
