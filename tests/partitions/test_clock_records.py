"""When a keyed partition writes its clock records (partitions/keyed.py), and what it stamps them:
ahead of the sidecar's clock, early enough that entries due just past the log's clock do not wait
for a round trip of the log, and one at a time. Pure."""

from sidecar.partitions.keyed import CLOCK_LEAD_MS, CLOCK_RETRY_MS, KeyedPartition
from sidecar.tracker.keys import MemoryKeys

HALF = CLOCK_LEAD_MS // 2


def test_an_isolated_entry_gets_a_clock_record_half_the_lead_before_its_time_stamped_past_it() -> None:
    keyed = KeyedPartition(MemoryKeys())
    keyed.note(0, 1_000)
    due = 10_000
    assert keyed.clock_due_at(due) == due - HALF
    assert keyed.clock_wanted(due, due - HALF - 1) is None
    stamp = keyed.clock_wanted(due, due - HALF)
    assert stamp == due - HALF + CLOCK_LEAD_MS and stamp > due
    assert keyed.clock_due_at(None) is None  # nothing pending: nothing to open


def test_entries_due_just_past_the_logs_clock_get_the_next_record_before_the_clock_runs_out() -> None:
    """The next entry is below the clock (already let through): the next record is still due once
    the clock is less than half the lead ahead, not when that entry has gone."""
    keyed = KeyedPartition(MemoryKeys())
    now = 50_000
    stamp = keyed.clock_wanted(now + 10, now)
    assert stamp is not None
    keyed.clock_sent_ms = now
    assert keyed.clock_due_at(now + 10) == now + CLOCK_RETRY_MS  # on its way: only a retry
    keyed.note(7, stamp)  # read back
    assert keyed.clock_sent_ms is None
    assert keyed.gate(now + 20) == now + 20  # never past the sidecar's clock
    assert keyed.clock_due_at(now + 20) == stamp + 1 - HALF < now + 20 + CLOCK_LEAD_MS // 2
    assert keyed.clock_wanted(now + 20, stamp - HALF) is None
    assert keyed.clock_wanted(now + 20, stamp + 1 - HALF) == stamp + 1 - HALF + CLOCK_LEAD_MS


def test_a_clock_record_not_read_back_is_written_again_once_overdue() -> None:
    keyed = KeyedPartition(MemoryKeys())
    keyed.clock_sent_ms = 1_000  # stamped 1_000 + CLOCK_LEAD_MS
    keyed.note(0, 1_000 + CLOCK_LEAD_MS - 1)  # an older stamp read: not ours
    assert keyed.clock_sent_ms == 1_000
    assert keyed.clock_wanted(1_010, 1_000 + CLOCK_RETRY_MS - 1) is None
    assert keyed.clock_wanted(1_010, 1_000 + CLOCK_RETRY_MS) == 1_000 + CLOCK_RETRY_MS + CLOCK_LEAD_MS
