"""bench/failover.py finds the transaction coordinator as Kafka does: Utils.abs(String.hashCode) % partitions.

A wrong hash would strike a node that coordinates nothing of the sidecar's, and the coordinator
test would pass without testing what it names (it also checks the struck node's own log)."""

from bench.failover import coordinator_partition, java_string_hash


def test_java_string_hash_matches_java() -> None:
    assert java_string_hash("") == 0
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("Hello, Kafka") == -517352160  # wraps past 2**31 as Java's int does
    assert java_string_hash("polygenelubricants") == -(2**31)
    assert java_string_hash("\U0001f600") == 1772899  # two UTF-16 code units, as Java stores it


def test_the_coordinator_partition_is_kafkas_abs_of_the_hash() -> None:
    assert coordinator_partition("hello", 50) == 99162322 % 50
    assert coordinator_partition("polygenelubricants", 50) == 0  # Utils.abs(Integer.MIN_VALUE) is 0
    assert coordinator_partition("Hello, Kafka", 50) == 517352160 % 50
