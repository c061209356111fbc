"""Monotone runs: stretches of a partition whose deliver-at rises with the offset, kept as one entry.

On a fixed-delay topic deliver-at is the publish time plus the delay, so it rises with the offset,
up to producer clock skew; so it does for any producer that delays alike. Indexing such records one
by one, and caching their payloads, is wasted work: a run is delivered by reading its offsets again
in order, a record at a time as each falls due (PIP-437's reason for fixed delays).

A run is four numbers: where reading resumes (`next`), the deliver-at reached there (`floor`), its
last offset and its top deliver-at. Which records in [next, last] belong to it is found again when
it is read, so membership depends only on the record, its intake rule and the members before it:

    a record is a member when it is delayed, carries a timestamp, and its deliver-at lies in
    [top, top + MAX_STEP_MS], top being the deliver-at of the member before it.

Everything else between - pass-through and rejected records, records out of order by producer
clock skew, a longer delay in between - is indexed one by one as before, and the run reads past it.
Intake never lets a record that would qualify stay outside its run (one already due closes the run
first), so a reread finds exactly the members intake counted.

Runs of one partition are ordered: a run opens only at or above the top of the one before, so
delivering runs in turn, interleaved with the index by (deliver-at, offset), keeps every pop in
key order and the delivered watermark exact. Runs live in the commit metadata (a few per
partition), not in the local index.

Pure code: no Kafka, no clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sidecar.tracker.base import pack

# Largest rise of deliver-at from one member to the next. A producer pausing for longer, or one
# record with a longer delay, does not join: the run goes on after it.
MAX_STEP_MS = 1_000
# Records in a row that do not join before the open run closes and the next one may open.
MAX_MISSES = 16
# A run shorter than this when it closes is not worth a read of its own: its members are indexed.
MIN_MEMBERS = 64
# Runs kept per partition; they travel in the commit metadata, which Kafka caps at 4 KB.
MAX_RUNS = 8

R = TypeVar("R")


def step_joins(top: int, deliver_at: int) -> bool:
    """The membership rule (see the module docstring)."""
    return top <= deliver_at <= top + MAX_STEP_MS


@dataclass
class Run:
    next: int
    """The offset reading resumes at: every member below it is delivered."""
    floor: int
    """The deliver-at of the last member delivered (of the first member, before any)."""
    last: int
    top: int
    members: int
    """Members not delivered yet."""
    read_next: int = -1
    """The reader's place (memory only): the offset after the last record it judged."""
    read_top: int = -1
    """The deliver-at of the last member the reader found (memory only)."""

    def __post_init__(self) -> None:
        self.rewind()

    def rewind(self) -> None:
        """Read again from the first undelivered member (a new owner, or buffers dropped)."""
        self.read_next, self.read_top = self.next, self.floor

    def delivered(self, offset: int, deliver_at: int) -> None:
        """The member at `offset` went out: reading resumes after it."""
        self.next, self.floor = offset + 1, deliver_at
        self.members -= 1

    def lower_bound(self) -> int:
        """No undelivered member has a smaller key (deliver-at, offset)."""
        return pack(self.floor, self.next)

    def encode(self) -> list[int]:
        return [self.next, self.floor, self.last, self.top, self.members]

    @classmethod
    def decode(cls, item: object) -> Run | None:
        if isinstance(item, list) and len(item) == 5 and all(isinstance(v, int) for v in item):
            return cls(*item)
        return None


@dataclass
class Runs(Generic[R]):
    """The runs of one partition, and the one intake may still extend.

    `R` is what intake holds for a member until its run is long enough to keep (a record).
    """

    runs: deque[Run] = field(default_factory=deque)
    open: bool = False
    _misses: int = 0
    _probation: list[tuple[int, int, R]] = field(default_factory=list)
    """(offset, deliver-at, record) of the open run's members while it is shorter than MIN_MEMBERS."""

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def pending(self) -> int:
        return sum(run.members for run in self.runs)

    def offer(self, offset: int, deliver_at: int, record: R) -> tuple[bool, list[tuple[int, int, R]]]:
        """A delayed record not yet due: (joined, dropped).

        joined: it is a member of a run (not indexed). dropped: members of a run too short to
        keep, which the caller indexes one by one (see `close`)."""
        run = self.runs[-1] if self.open else None
        dropped: list[tuple[int, int, R]] = []
        if run is not None:
            top = run.top
            if top <= deliver_at <= top + MAX_STEP_MS:  # step_joins, inline: every delayed record passes here
                run.last, run.top = offset, deliver_at
                run.members += 1
                self._misses = 0
                if self._probation:
                    self._probation.append((offset, deliver_at, record))
                    if len(self._probation) >= MIN_MEMBERS:
                        self._probation = []  # long enough: kept
                return True, dropped
            self._misses += 1
            if self._misses < MAX_MISSES:
                return False, dropped
            dropped = self.close()
        if len(self.runs) >= MAX_RUNS or (self.runs and deliver_at < self.runs[-1].top):
            return False, dropped  # runs stay in key order; this one is indexed
        self.runs.append(Run(offset, deliver_at, offset, deliver_at, 1))
        self.open, self._misses = True, 0
        self._probation = [(offset, deliver_at, record)]
        return True, dropped

    def would_join(self, deliver_at: int) -> bool:
        """A record that intake cannot make a member (it is due already) but that a reread would count."""
        return self.open and step_joins(self.runs[-1].top, deliver_at)

    def close(self) -> list[tuple[int, int, R]]:
        """No more members for the open run. A run still on probation is dropped: its members
        come back, to be indexed one by one."""
        dropped: list[tuple[int, int, R]] = []
        if self.open and self._probation:
            dropped = self._probation
            self.runs.pop()
        self.open, self._misses, self._probation = False, 0, []
        return dropped

    def settle(self) -> list[tuple[int, int, R]]:
        """At the end of an intake batch: a run still on probation is dropped (see `close`), so
        what a checkpoint commits never depends on records intake no longer holds."""
        return self.close() if self._probation else []

    def lower_bound(self) -> int | None:
        """The smallest key a pending member can have, or None without pending members."""
        for run in self.runs:
            if run.members:
                return run.lower_bound()
        return None

    def earliest_offset(self) -> int | None:
        return next((run.next for run in self.runs if run.members), None)

    def drop_done(self) -> None:
        """Forget runs with nothing left to deliver that intake can no longer extend."""
        while self.runs and self.runs[0].members == 0 and not (self.open and len(self.runs) == 1):
            self.runs.popleft()

    def encode(self) -> list[list[int]]:
        return [run.encode() for run in self.runs if run.members]

    @classmethod
    def decode(cls, items: object) -> Runs[R]:
        """Runs from the commit metadata: all closed (intake opens new ones above them)."""
        runs: deque[Run] = deque()
        if isinstance(items, list):
            for item in items:
                run = Run.decode(item)
                if run is not None and run.members > 0:
                    runs.append(run)
        return cls(runs)
