"""Tracker: the index of delayed positions, after Pulsar's DelayedDeliveryTracker."""

from sidecar.tracker.base import DelayedDeliveryTracker, Due
from sidecar.tracker.memory import InMemoryTracker

__all__ = ["DelayedDeliveryTracker", "Due", "InMemoryTracker"]
