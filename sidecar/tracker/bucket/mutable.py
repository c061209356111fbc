"""The mutable bucket: where adds land until there are enough to seal (Pulsar's MutableBucket).

Unlike Pulsar's, it is durable: its adds go to a write-ahead log at each checkpoint, so a crash
after a checkpoint loses nothing (Pulsar loses the last mutable bucket).
"""

from __future__ import annotations

from array import array

from pyroaring import BitMap64
from sortedcontainers import SortedList

from sidecar.tracker.bucket.immutable import NO_KEY, ImmutableBucket, cut_segments, latest_per_offset
from sidecar.tracker.storage.base import KEY_SHIFT, OFFSET_MASK, BucketWrite, Segment

_SHIFT = KEY_SHIFT
_MASK = OFFSET_MASK
NO_AT = NO_KEY >> _SHIFT
"""Later than any deliver-at: the earliest deliver-at of an empty buffer."""
_WAL_COMPACT_MIN = 4096
"""Below this many logged entries the write-ahead log is never rewritten."""


class MutableBucket:
    """The entries added since the last seal, in memory, and what of them is logged.

    The tracker's add and pop_due write these attributes directly rather than through methods:
    they run once per message, where a method call would cost a sizeable share of an add.
    """

    __slots__ = (
        "bitmap",
        "count",
        "max_offset",
        "popped",
        "sorted_keys",
        "unsorted_at",
        "unsorted_min_at",
        "unsorted_offsets",
        "wal_at",
        "wal_mark",
        "wal_offsets",
        "wal_stored",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Empty the bucket: after a seal, whose bucket holds the entries now, or on clear and close."""
        self.sorted_keys: SortedList = SortedList()
        self.unsorted_at: array[int] = array("q")
        self.unsorted_offsets: array[int] = array("Q")
        """Recent adds not yet in the sorted list, as two columns: an append is several times
        cheaper than an insort, and nothing in here is needed in order until its earliest
        deliver-at falls due or a seal. Columns hold an entry in 16 bytes where a packed int in a
        list takes 48; a seal builds the keys all at once, faster than one per add."""
        self.unsorted_min_at = NO_AT
        self.count = 0
        """Entries in the sorted list and the unsorted columns (SortedList's len is a Python call)."""
        self.bitmap = BitMap64()
        self.max_offset = -1
        self.popped: list[int] = []
        """Keys popped since the last checkpoint: a seal writes them into its snapshot too, so that
        a crash before the checkpoint brings them back."""
        self.wal_at: array[int] = array("q")
        self.wal_offsets: array[int] = array("Q")
        """Adds not yet logged that have moved from the unsorted columns to the sorted list."""
        self.wal_mark = 0
        """Unsorted entries from this index on are not logged yet: the log of the mutable bucket
        is these plus `wal_at`/`wal_offsets`, so an add is written to memory once."""
        self.wal_stored = 0
        """Entries in the stored log, delivered ones included: what decides when it is rewritten."""

    def recover(self, chunks: list[Segment], through: int) -> None:
        """Rebuild from the write-ahead log: the latest add of each offset, if later than `through`."""
        latest: dict[int, int] = {}
        for chunk in chunks:
            self.wal_stored += len(chunk)
            for d, o in zip(chunk.deliver_at, chunk.offsets, strict=True):
                latest[o] = d
        keys = [d << _SHIFT | o for o, d in latest.items() if d << _SHIFT | o > through]
        self.sorted_keys = SortedList(keys)
        self.count = len(keys)
        self.bitmap = BitMap64(array("Q", [k & _MASK for k in keys]))
        self.max_offset = self.bitmap.max() if keys else -1

    def merge_unsorted(self) -> SortedList:
        """The sorted keys, with the recent adds moved in (and kept for the log)."""
        at, offsets, mark = self.unsorted_at, self.unsorted_offsets, self.wal_mark
        if offsets:
            if mark < len(offsets):
                self.wal_at.extend(at[mark:])
                self.wal_offsets.extend(offsets[mark:])
            self.sorted_keys.update([d << _SHIFT | o for d, o in zip(at, offsets, strict=True)])
            self.unsorted_at, self.unsorted_offsets = array("q"), array("Q")
            self.unsorted_min_at, self.wal_mark = NO_AT, 0
        return self.sorted_keys

    def seal(self, bucket_id: int, step: int, max_per_segment: int) -> tuple[ImmutableBucket, BucketWrite] | None:
        """The sealed bucket these entries make, and its write; None when there is nothing to keep.

        Pops that are not durable yet go into the snapshot too (a crash must bring them back),
        but not into the new bucket's pending bitmap. The bucket is not emptied here: the
        caller resets it once storage has the write.
        """
        pending_keys = list(self.sorted_keys)
        if self.unsorted_offsets:
            pending_keys += [d << _SHIFT | o for d, o in zip(self.unsorted_at, self.unsorted_offsets, strict=True)]
            pending_keys.sort()
        popped_keys = latest_per_offset(self.popped, self.bitmap)
        keys = popped_keys + pending_keys if popped_keys else pending_keys
        if not keys:
            # Only superseded pops: nothing to snapshot, the mutable bucket stays as it is.
            return None
        segments = cut_segments(keys, step, max_per_segment)
        bitmap = self.bitmap
        bitmap.run_optimize()
        if popped_keys:
            stored = bitmap.copy()
            stored.update(array("Q", [k & _MASK for k in popped_keys]))
            stored.run_optimize()
        else:
            stored = bitmap
        return ImmutableBucket.create(
            bucket_id, segments, stored, stored.min(), stored.max(), bitmap, len(pending_keys)
        )

    def wal_chunk(self) -> tuple[Segment | None, bool, int]:
        """What a checkpoint writes to the log: (chunk or None, whether it replaces the log, entries logged after).

        Appends what was added since the last checkpoint; once the log is mostly delivered
        entries, rewrites it with what is pending instead, so it stays small.
        """
        wal_stored, mark = self.wal_stored, self.wal_mark
        logged = len(self.wal_offsets) + len(self.unsorted_offsets) - mark
        if wal_stored + logged > max(4 * self.count, _WAL_COMPACT_MIN):
            keys = list(self.merge_unsorted())
            chunk = Segment(array("q", [k >> _SHIFT for k in keys]), array("Q", [k & _MASK for k in keys]))
            return chunk, True, len(keys)
        if logged:
            at = self.wal_at + self.unsorted_at[mark:]
            offsets = self.wal_offsets + self.unsorted_offsets[mark:]
            return Segment(at, offsets), False, wal_stored + logged
        return None, False, wal_stored

    def checkpointed(self, appended: bool, wal_stored: int) -> None:
        """A checkpoint is durable: what it logged is no longer pending for the log, and pops are final."""
        if appended:
            self.wal_at, self.wal_offsets = array("q"), array("Q")
            self.wal_mark = len(self.unsorted_offsets)
        self.wal_stored = wal_stored
        self.popped.clear()
