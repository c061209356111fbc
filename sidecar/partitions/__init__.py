"""Inbound partitions as the consumer group gives them: commit metadata, per-partition state, the assignment."""

TopicPartitionKey = tuple[str, int]
"""(topic, partition): how every step names an inbound partition."""
