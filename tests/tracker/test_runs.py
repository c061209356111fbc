"""Monotone runs, without Kafka: who joins, when a run closes or is dropped, and that a reread of a
run's offsets finds exactly the members intake counted."""

from hypothesis import given
from hypothesis import strategies as st

from sidecar.tracker.base import pack
from sidecar.tracker.runs import MAX_MISSES, MAX_RUNS, MAX_STEP_MS, MIN_MEMBERS, Run, Runs, step_joins

Record = tuple[int, int]  # (offset, deliver-at)


def intake(records: list[Record], close_each: int = 0) -> tuple[Runs[int], set[int], list[int]]:
    """Offer every record as live intake does; returns (runs, members kept, offsets indexed one by one)."""
    runs: Runs[int] = Runs()
    joined: set[int] = set()
    indexed: list[int] = []
    for i, (offset, deliver_at) in enumerate(records):
        ok, dropped = runs.offer(offset, deliver_at, offset)
        for o, _, _ in dropped:
            joined.discard(o)
            indexed.append(o)
        (joined.add if ok else indexed.append)(offset)
        if close_each and i % close_each == close_each - 1:
            for o, _, _ in runs.settle():
                joined.discard(o)
                indexed.append(o)
    for o, _, _ in runs.settle():
        joined.discard(o)
        indexed.append(o)
    return runs, joined, indexed


def reread(runs: Runs[int], deliver_at: dict[int, int]) -> list[int]:
    """What the trail reader finds: each run's offsets in order, judged with the membership rule."""
    found = []
    for run in runs.runs:
        top = run.floor
        for offset in range(run.next, run.last + 1):
            at = deliver_at.get(offset)
            if at is not None and step_joins(top, at):
                found.append(offset)
                top = at
    return found


def test_a_fixed_delay_stream_is_one_run() -> None:
    records = [(o, 1_000 + o // 10) for o in range(1_000)]
    runs, joined, indexed = intake(records)
    assert len(runs) == 1 and indexed == [] and len(joined) == 1_000
    run = runs.runs[0]
    assert (run.next, run.floor, run.last, run.top, run.members) == (0, 1_000, 999, 1_099, 1_000)


def test_a_longer_delay_in_between_is_indexed_and_the_run_goes_on() -> None:
    records = [(o, 1_000 + o) for o in range(200)]
    records[100] = (100, 90_000)  # one record with a much longer delay
    runs, _joined, indexed = intake(records)
    assert indexed == [100] and len(runs) == 1 and runs.runs[0].members == 199


def test_clock_skew_backwards_is_indexed_and_forwards_opens_a_new_run() -> None:
    records = [(o, 10_000 + o) for o in range(100)]
    records += [(100 + o, 9_000 + o) for o in range(50)]  # the producer clock stepped back 1 s
    records += [(150 + o, 60_000 + o) for o in range(100)]  # then forwards by 50 s
    runs, _joined, indexed = intake(records)
    assert set(range(100, 150)) <= set(indexed)
    assert len(runs) == 2 and runs.runs[1].floor >= runs.runs[0].top  # runs stay in key order


def test_a_short_run_is_dropped_and_its_members_indexed() -> None:
    records = [(o, 1_000 + o) for o in range(MIN_MEMBERS - 1)]
    runs, joined, indexed = intake(records)
    assert len(runs) == 0 and joined == set() and sorted(indexed) == list(range(MIN_MEMBERS - 1))


def test_random_delays_form_no_run() -> None:
    records = [(o, 1_000 + (o * 7_919) % 60_000) for o in range(5_000)]
    runs, _joined, indexed = intake(records)
    assert len(runs) == 0 and len(indexed) == 5_000


def test_runs_per_partition_are_capped() -> None:
    records: list[Record] = []
    offset = 0
    for i in range(MAX_RUNS + 3):  # each pause longer than a step starts a new run
        base = 1_000 + i * 10 * MAX_STEP_MS
        records += [(offset + j, base + j) for j in range(MIN_MEMBERS + MAX_MISSES)]
        offset += MIN_MEMBERS + MAX_MISSES
    runs, joined, indexed = intake(records)
    assert len(runs) == MAX_RUNS
    assert len(joined) + len(indexed) == len(records)


def test_delivery_moves_the_run_and_its_lower_bound() -> None:
    runs, _, _ = intake([(o, 1_000 + o) for o in range(100)])
    run = runs.runs[0]
    assert runs.lower_bound() == pack(1_000, 0)
    run.delivered(0, 1_000)
    runs.drop_done()
    assert (run.next, run.floor, run.members) == (1, 1_000, 99)
    assert runs.lower_bound() == pack(1_000, 1) and runs.earliest_offset() == 1


def test_runs_survive_the_commit_metadata_closed() -> None:
    runs, _, _ = intake([(o, 1_000 + o) for o in range(100)], close_each=0)
    again: Runs[int] = Runs.decode(runs.encode())
    assert [r.encode() for r in again.runs] == [r.encode() for r in runs.runs] and not again.open
    assert Runs.decode("garbage").runs == Runs.decode([[1, 2]]).runs == Runs[int]().runs
    assert Run.decode([1, 2, 3, 4, 5]) == Run(1, 2, 3, 4, 5)


@given(
    st.lists(
        st.one_of(
            st.integers(0, 30),  # small rises: a fixed delay
            st.integers(-2_000, 2_000),  # skew
            st.integers(0, 100_000),  # a longer delay
            st.none(),  # a record that is not delayed
        ),
        max_size=600,
    ),
    st.integers(0, 200),
)
def test_a_reread_finds_exactly_the_members(steps: list[int | None], close_each: int) -> None:
    """The property delivery rests on: reading a run's offsets again and applying the rule finds the
    records intake made members, no more (a duplicate) and no fewer (a loss)."""
    at, records, deliver_at = 10_000, [], {}
    for offset, step in enumerate(steps):
        if step is None:
            continue  # pass-through: intake never offers it, the reread never counts it
        at = max(at + step, 0)
        records.append((offset, at))
        deliver_at[offset] = at
    runs, joined, indexed = intake(records, close_each)
    assert sorted(reread(runs, deliver_at)) == sorted(joined)
    assert sorted(joined | set(indexed)) == sorted(o for o, _ in records)
    assert not joined & set(indexed)
    assert sum(r.members for r in runs.runs) == len(joined)
