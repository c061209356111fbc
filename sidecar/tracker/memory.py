"""The simple tracker: everything in memory, rebuilt by replaying the log after a restart.

It is the reference the bucket tracker is measured and checked against. Each entry is a single
Python int, `deliver_at << 64 | offset`, in a binary heap: integer comparison gives deliver-at
order and then offset (FIFO) order, with no tuple per entry.
"""

import bisect
import heapq

from pyroaring import BitMap64

from sidecar.clock import Clock
from sidecar.tracker.base import KEY_SHIFT, NOTHING_DELIVERED, DelayedDeliveryTracker, Due, due_of

_OFFSET_BITS = KEY_SHIFT
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


class InMemoryTracker(DelayedDeliveryTracker):
    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._heap: list[int] = []
        self._pending = BitMap64()
        self._popped = NOTHING_DELIVERED

    def add(self, offset: int, deliver_at: int, *, deliver_now: bool = True) -> bool:
        if offset in self._pending:
            return True
        key = deliver_at << _OFFSET_BITS | offset
        if key <= self._popped:
            return False
        if deliver_now and deliver_at <= self.clock.now_ms() and (not self._heap or key < self._heap[0]):
            self._popped = key
            return False
        heapq.heappush(self._heap, key)
        self._pending.add(offset)
        return True

    def due_counts(self, limits: list[int]) -> list[int]:
        ats = sorted(key >> _OFFSET_BITS for key in self._heap)
        return [bisect.bisect_right(ats, limit) for limit in limits]

    def next_delivery_time(self) -> int | None:
        return self._heap[0] >> _OFFSET_BITS if self._heap else None

    def pop_due(self, max_messages: int, until_ms: int | None = None) -> list[Due]:
        limit = ((self.clock.now_ms() if until_ms is None else until_ms) + 1) << _OFFSET_BITS
        heap, due = self._heap, list[Due]()
        pop, discard = heapq.heappop, self._pending.discard
        while heap and heap[0] < limit and len(due) < max_messages:
            key = pop(heap)
            offset = key & _OFFSET_MASK
            discard(offset)
            due.append(due_of((key >> _OFFSET_BITS, offset)))
        if due:
            self._popped = max(self._popped, due[-1].deliver_at << _OFFSET_BITS | due[-1].offset)
        return due

    def peek(self, after: Due | None, until_ms: int, max_messages: int) -> list[Due]:
        # Walk the heap from the root, pruning subtrees whose root is already past the limit: the
        # cost follows the number of entries due by until_ms, not the size of the heap.
        low = after.deliver_at << _OFFSET_BITS | after.offset if after is not None else -1
        limit = (until_ms + 1) << _OFFSET_BITS
        heap, found, stack = self._heap, list[int](), [0]
        while stack:
            i = stack.pop()
            if i < len(heap) and heap[i] < limit:
                if heap[i] > low:
                    found.append(heap[i])
                stack += (2 * i + 1, 2 * i + 2)
        found.sort()
        return [Due(key >> _OFFSET_BITS, key & _OFFSET_MASK) for key in found[:max_messages]]

    def contains(self, offset: int) -> bool:
        return offset in self._pending

    def delivered_through(self) -> int:
        return self._popped

    def restore_delivered_through(self, key: int) -> None:
        self._popped = key

    def __len__(self) -> int:
        return len(self._heap)

    def earliest_pending_offset(self) -> int | None:
        return self._pending.min() if self._pending else None

    @property
    def durable(self) -> bool:
        return False

    def clear(self) -> None:
        super().clear()
        self._heap.clear()
        self._pending.clear()
        self._popped = NOTHING_DELIVERED

    def close(self) -> None:
        self.clear()
