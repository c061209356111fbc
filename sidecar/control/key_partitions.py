"""The partitions a producer may have put a key in: where a command by key has to ask.

A command by key names a topic and a key, not a partition. A producer places a keyed record by a
hash of the key, and the two hashes in use disagree: librdkafka's default partitioner
(`consistent_random`: confluent-kafka, and the Go, .NET and C clients built on librdkafka) takes the
CRC-32 of the key, Java's default partitioner murmur2 (as librdkafka's `murmur2_random` does). The
sidecar cannot tell which producer wrote a key, so it asks both partitions; they are the same one
for about one key in `n`.

Both partitioners place an empty key as they place no key (librdkafka at random; Java's sticky
partitioner for a null key), so an empty key names nothing and a keyed topic treats it as no key.
"""

import zlib

_M = 0x5BD1E995
_SEED = 0x9747B28C
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (org.apache.kafka.common.utils.Utils.murmur2), as a signed 32-bit int."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def java_partition(key: bytes, partitions: int) -> int:
    """Where Java's default partitioner (and librdkafka's `murmur2_random`) puts `key`."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def librdkafka_partition(key: bytes, partitions: int) -> int:
    """Where librdkafka's default partitioner (`consistent_random`) puts `key`."""
    return zlib.crc32(key) % partitions


def key_partitions(key: bytes, partitions: int) -> tuple[int, ...]:
    """The partitions `key` may be in, in ascending order: one or two."""
    if not key:
        raise ValueError("an empty key is placed as no key is, at random: it names no partition")
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    return tuple(sorted({librdkafka_partition(key, partitions), java_partition(key, partitions)}))
