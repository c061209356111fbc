"""Inbound partitions as the consumer group gives them: commit metadata, per-partition state, the assignment."""
