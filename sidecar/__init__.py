"""Delay sidecar: Pulsar-style delayed delivery for Kafka.

The package follows the flow of a record:
inbound -> policy -> tracker -> dispatch -> outbound, and control -> tracker.
"""

__version__ = "0.1.0"
