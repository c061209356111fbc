"""The bucket tracker (PIP-195): a durable, bounded-memory index of delayed positions."""

from sidecar.tracker.bucket.stats import NullListener, TrackerListener, TrackerStats
from sidecar.tracker.bucket.tracker import BucketTracker

__all__ = ["BucketTracker", "NullListener", "TrackerListener", "TrackerStats"]
