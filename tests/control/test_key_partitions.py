"""The partitions a command by key asks (control/key_partitions.py) are where producers put the key.

Java's side: the hashes below are what kafka-clients 4.1.1's Utils.murmur2 returned for these keys
(jshell, UTF-8 bytes), and the partitions what its default partitioner computes from them. The
librdkafka side is checked against librdkafka itself: its two partitioners place keyed records on a
real topic.
"""

import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Producer
from hypothesis import given
from hypothesis import strategies as st

from sidecar.control.key_partitions import java_partition, key_partitions, librdkafka_partition, murmur2
from tests.kafka_helpers import KafkaHelper

JAVA = [  # key, Utils.murmur2(key), toPositive(murmur2) % 12
    ("", 275646681, 9),
    ("a", -1563381124, 4),
    ("21", -973932308, 0),
    ("abc", 479470107, 3),
    ("foobar", -790332482, 6),
    ("order-77", -436693316, 0),
    ("user-1234567", 928168879, 7),
    ("a-little-bit-long-string", -985981536, 8),
    ("été", -2101193575, 1),
]


@pytest.mark.parametrize(("key", "hashed", "partition"), JAVA)
def test_murmur2_is_javas(key: str, hashed: int, partition: int) -> None:
    assert murmur2(key.encode()) == hashed
    assert java_partition(key.encode(), 12) == partition


@given(st.binary(min_size=1, max_size=64), st.integers(1, 500))
def test_a_key_is_asked_for_in_one_or_two_partitions_of_the_topic(key: bytes, partitions: int) -> None:
    asked = key_partitions(key, partitions)
    assert asked == tuple(sorted({java_partition(key, partitions), librdkafka_partition(key, partitions)}))
    assert all(0 <= p < partitions for p in asked) and len(asked) in (1, 2)


def test_an_empty_key_names_no_partition() -> None:
    with pytest.raises(ValueError, match="empty key"):
        key_partitions(b"", 6)


def test_librdkafka_puts_keys_where_the_command_asks(
    kafka: str, topic_factory: Callable[..., str], kafka_helper: KafkaHelper
) -> None:
    """Both of librdkafka's keyed partitioners on a real topic of 12 partitions: its default
    (`consistent_random`, CRC-32) and `murmur2_random` (Java's)."""
    keys = [f"user-{uuid.uuid4().hex[:8]}-{i}".encode() for i in range(200)] + ["été".encode(), b"\x00\xff"]
    for partitioner, place in (("consistent_random", librdkafka_partition), ("murmur2_random", java_partition)):
        topic = topic_factory("keys", partitions=12)
        producer = Producer({"bootstrap.servers": kafka, "partitioner": partitioner})
        for key in keys:
            producer.produce(topic, b"v", key=key)
        assert producer.flush(30) == 0
        placed = {r.key: r.partition for r in kafka_helper.read_to_end(topic)}
        assert placed == {key: place(key, 12) for key in keys}, partitioner
