"""The bucket tracker against a reference model (a sorted list), over random operation sequences.

Crash semantics in the model: the machine always checkpoints before it reopens, so a reopen must
lose nothing and bring nothing back. Pops that were not checkpointed may come back after a crash
(at-least-once); that case has its own targeted tests in test_bucket_tracker.py
(test_popped_but_not_checkpointed_entries_come_back and the recover-snapshot test).

Storage faults are injected on the fake: while a segment load fails, pop_due may return fewer
entries than the model (it never skips), but what it returns is always the model's next entries.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sidecar.clock import ManualClock
from sidecar.tracker.base import Due
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.storage import FakeSnapshotStorage, RocksDbSnapshotStorage, SnapshotStorage

from .conftest import make_tracker

PARTITION = "orders/7"


class Model:
    """The contract of base.py, as plainly as it can be written."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.pending: dict[int, int] = {}
        self.popped = Due(-1, -1)
        """The delivered watermark: every entry leaves in (deliver-at, offset) order."""

    def add(self, offset: int, deliver_at: int, deliver_now: bool = True) -> bool:
        if offset in self.pending:
            return True
        key = Due(deliver_at, offset)
        if key <= self.popped:
            return False  # due by an earlier pop: delivered now
        due_first = deliver_at < min(self.pending.values(), default=deliver_at + 1)
        if deliver_now and deliver_at <= self.clock.now_ms() and due_first:
            self.popped = key  # due and first in line: delivered now, as if popped
            return False
        self.pending[offset] = deliver_at  # not due, or due behind indexed entries
        return True

    def due(self) -> list[Due]:
        now = self.clock.now_ms()
        return sorted(Due(at, offset) for offset, at in self.pending.items() if at <= now)

    def remove(self, entries: list[Due]) -> None:
        for entry in entries:
            assert self.pending.pop(entry.offset) == entry.deliver_at
            self.popped = max(self.popped, entry)

    def next_delivery_time(self) -> int | None:
        return min(self.pending.values(), default=None)


class TrackerMachine(RuleBasedStateMachine):
    faults = False

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(1_000_000)
        self.model = Model(self.clock)
        self.next_offset = 0
        self.config = {
            "min_index_count": 5,
            "time_step_ms": 40,
            "max_indexes_per_segment": 3,
            "max_buckets": 3,
        }

    def open_storage(self) -> SnapshotStorage:
        raise NotImplementedError

    def close_storage(self) -> None:
        pass

    @initialize(
        min_index_count=st.integers(1, 8),
        max_buckets=st.integers(1, 4),
        max_per_segment=st.integers(1, 5),
    )
    def start(self, min_index_count: int, max_buckets: int, max_per_segment: int) -> None:
        self.config.update(
            min_index_count=min_index_count, max_buckets=max_buckets, max_indexes_per_segment=max_per_segment
        )
        self.storage = self.open_storage()
        self.tracker = self.open_tracker()

    def open_tracker(self) -> BucketTracker:
        return make_tracker(self.clock, self.storage, PARTITION, **self.config)

    @rule(delay=st.integers(-5, 400), count=st.integers(1, 6))
    def add_new(self, delay: int, count: int) -> None:
        for _ in range(count):
            offset = self.next_offset
            self.next_offset += 1
            at = self.clock.now_ms() + delay
            assert self.tracker.add(offset, at) == self.model.add(offset, at)

    @rule(
        delays=st.lists(st.integers(-5, 400), min_size=1, max_size=12),
        gaps=st.lists(st.integers(1, 3), max_size=12),
        deliver_now=st.booleans(),
    )
    def add_slice(self, delays: list[int], gaps: list[int], deliver_now: bool) -> None:
        """A slice of intake in one call (the tracker's one-step path, or its fall-back): the same
        answers as one add at a time, whether offsets follow each other or leave gaps, and whether
        due ones are delivered now or indexed (a keyed partition's gate)."""
        offsets, ats = [], []
        for i, delay in enumerate(delays):
            offsets.append(self.next_offset)
            ats.append(self.clock.now_ms() + delay)
            self.next_offset += gaps[i] if i < len(gaps) else 1
        expected = [
            i
            for i, (offset, at) in enumerate(zip(offsets, ats, strict=True))
            if not self.model.add(offset, at, deliver_now)
        ]
        assert self.tracker.add_many(offsets, ats, deliver_now=deliver_now) == expected

    @precondition(lambda self: self.next_offset > 0)
    @rule(data=st.data(), delay=st.integers(-5, 400))
    def re_add_old(self, data: st.DataObject, delay: int) -> None:
        """A replayed record (already indexed) or a nack of a delivered one."""
        offset = data.draw(st.integers(0, self.next_offset - 1))
        at = self.clock.now_ms() + delay
        assert self.tracker.add(offset, at) == self.model.add(offset, at)

    @rule(ms=st.integers(0, 120))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule(n=st.integers(1, 12))
    def pop_due(self, n: int) -> None:
        expected = self.model.due()[:n]
        got = self.tracker.pop_due(n)
        assert got == expected[: len(got)], (got, expected)
        if len(got) < len(expected):
            assert self.faults and "load" in self.tracker.stats().degraded_ops
        for entry in got:
            assert entry.deliver_at <= self.clock.now_ms()
        self.model.remove(got)

    @rule()
    def seal(self) -> None:
        self.tracker.seal()

    @rule()
    def merge(self) -> None:
        self.tracker.merge()

    @rule()
    def checkpoint(self) -> None:
        self.tracker.checkpoint(self.next_offset)

    @rule()
    def reopen(self) -> None:
        self.heal()
        self.tracker.checkpoint(self.next_offset)
        assert "checkpoint" not in self.tracker.stats().degraded_ops
        self.tracker.close()
        self.close_storage()
        self.storage = self.open_storage()
        self.tracker = self.open_tracker()
        assert self.tracker.index_cursor() == self.next_offset

    def heal(self) -> None:
        pass

    @invariant()
    def same_view(self) -> None:
        if not hasattr(self, "tracker"):
            return
        assert len(self.tracker) == len(self.model.pending)
        if not self.tracker.degraded:
            assert self.tracker.next_delivery_time() == self.model.next_delivery_time()
        expected_earliest = min(self.model.pending, default=None)
        assert self.tracker.earliest_pending_offset() == expected_earliest
        for offset in range(max(0, self.next_offset - 20), self.next_offset):
            assert self.tracker.contains(offset) == (offset in self.model.pending)

    def teardown(self) -> None:
        if hasattr(self, "tracker"):
            self.heal()
            self.clock.advance(10_000)
            rest = self.tracker.pop_due(1_000_000)
            assert rest == self.model.due()
            self.tracker.close()
            self.close_storage()


class FakeStorageMachine(TrackerMachine):
    faults = True
    shared: FakeSnapshotStorage

    def open_storage(self) -> SnapshotStorage:
        if not hasattr(self, "shared"):
            self.shared = FakeSnapshotStorage()
        return self.shared

    def heal(self) -> None:
        self.shared.heal()

    @rule(kind=st.sampled_from(["create", "load", "merge", "delete", "checkpoint"]), count=st.integers(1, 3))
    def inject_fault(self, kind: str, count: int) -> None:
        self.shared.fail(kind, count)  # type: ignore[arg-type]


class RocksDbMachine(TrackerMachine):
    def open_storage(self) -> SnapshotStorage:
        if not hasattr(self, "path"):
            self.path = Path(tempfile.mkdtemp(prefix="tracker-model-"))
        self.rocks = RocksDbSnapshotStorage(self.path, sync=False, lock_timeout_s=1)
        return self.rocks

    def close_storage(self) -> None:
        self.rocks.close()

    def teardown(self) -> None:
        super().teardown()
        if hasattr(self, "path"):
            shutil.rmtree(self.path, ignore_errors=True)


FakeStorageMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
RocksDbMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestWithFakeStorage = FakeStorageMachine.TestCase
TestWithRocksDb = RocksDbMachine.TestCase
