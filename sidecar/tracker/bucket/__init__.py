"""The bucket tracker (PIP-195): a durable, bounded-memory index of delayed positions.

Split as Pulsar's bucket tracker is:

* `mutable.py`: the mutable bucket, where adds land, and its write-ahead log;
* `immutable.py`: a sealed (immutable) bucket, its segments and its snapshot format;
* `merge.py`: which sealed buckets to merge, and the bucket they merge into;
* `tracker.py`: `BucketTracker`, which composes them.

Two helpers serve the tracker: `buckets.py` holds the sealed buckets together, with the shared
queue of their heads, and applies merges and deletes; `store.py` holds the partition's root
record and makes the retried storage calls. `stats.py` has the metrics hooks.
"""

from sidecar.tracker.bucket.stats import NullListener, TrackerListener, TrackerStats
from sidecar.tracker.bucket.tracker import BucketTracker

__all__ = ["BucketTracker", "NullListener", "TrackerListener", "TrackerStats"]
