"""The payload cache on its own: key order, byte budget, and what makes it drop itself at start."""

import itertools
import marshal
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Message
from hypothesis import given
from hypothesis import strategies as st

from sidecar.dispatch.payload_cache import (
    SLOT_MS,
    ByteBudget,
    PayloadCache,
    _chunks,
    decode_key,
    encode_key,
    entry,
    to_message,
)
from sidecar.tracker import Due

OWNER = "cluster-1/delay-sidecar"
T0 = 1_800_000_000_000
TOPICS = st.sampled_from(["a", "ab", "b", "orders", "orders.eu", "orders-2", "x" * 40])
KEYS = st.tuples(st.integers(0, 2**63), TOPICS, st.integers(0, 2**31 - 1), st.integers(0, 2**63))


@given(st.lists(KEYS, min_size=2, max_size=50, unique=True))
def test_keys_sort_as_deliver_at_topic_partition_offset(entries: list[tuple[int, str, int, int]]) -> None:
    assert sorted(entries, key=lambda e: encode_key(*e)) == sorted(entries)
    assert all(decode_key(encode_key(*e)) == e for e in entries)


@given(
    st.dictionaries(
        st.sampled_from([("a", 0), ("a", 1), ("b", 0)]),
        st.lists(st.tuples(st.integers(0, 50), st.integers(0, 10**6)), max_size=60),
    ),
    st.integers(1, 20),
)
def test_chunks_cover_everything_once_earliest_first(
    wanted: dict[tuple[str, int], list[tuple[int, int]]], size: int
) -> None:
    dues = {p: [Due(*e) for e in sorted(set(entries))] for p, entries in wanted.items()}
    chunks = list(_chunks(dues, size))
    for p, entries in dues.items():
        assert [d for c in chunks for d in c.get(p, [])] == entries
    for before, after in itertools.pairwise(chunks):
        # One range of whole slots each: every slot of a chunk precedes every one of the next.
        assert max(d.deliver_at // SLOT_MS for c in before.values() for d in c) < min(
            d.deliver_at // SLOT_MS for c in after.values() for d in c
        )
    assert all(chunk and all(chunk.values()) for chunk in chunks)


def record(offset: int, value: bytes = b"v", headers: list[tuple[str, bytes | None]] | None = None) -> Message:
    return Message(topic="orders", partition=1, offset=offset, key=b"k", value=value, headers=headers,
                   timestamp=(1, 1_700_000_000_123))  # fmt: skip


def test_values_keep_everything_delivery_uses() -> None:
    headers: list[tuple[str, bytes | None]] = [("deliver-at", b"1"), ("empty", None)]
    back = to_message("orders", 1, marshal.loads(marshal.dumps(entry(T0, record(7, b"payload", headers), headers))))
    assert (back.topic(), back.partition(), back.offset()) == ("orders", 1, 7)
    assert (back.key(), back.value(), back.headers(), back.timestamp()) == (
        b"k",
        b"payload",
        headers,
        (1, 1_700_000_000_123),
    )


def test_budget_stops_at_the_limit_logs_once_and_resumes_after_deletions(caplog: pytest.LogCaptureFixture) -> None:
    budget = ByteBudget(1000)
    assert budget.take(T0, 600) and budget.take(T0 + 1500, 300)
    assert not budget.take(T0 + 2000, 200)  # 1100 > 1000
    assert not budget.take(T0 + 2000, 1)  # stays full: no flapping on small entries
    assert budget.used == 900
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "payload cache full" in caplog.records[0].message
    assert budget.release_before((T0 + 1000) // 1000) == 600  # the second of T0 only
    assert budget.used == 300 and not budget.full
    assert budget.take(T0 + 2000, 200)


def open_cache(path: Path, budget: int = 1 << 20, horizon_ms: int = 600_000, owner: str = OWNER) -> PayloadCache:
    cache = PayloadCache.open(path, owner=owner, budget_bytes=budget, horizon_ms=horizon_ms)
    assert cache is not None
    return cache


def put(cache: PayloadCache, now: int, *entries: tuple[int, int]) -> None:
    batch = cache.batch(now)
    for offset, deliver_at in entries:
        batch.add("orders", 1, offset, deliver_at, record(offset, f"v{offset}".encode()))
    batch.write()


P = ("orders", 1)


def test_a_payload_is_found_only_with_its_own_deliver_at(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "cache")
    put(cache, T0, (1, T0 + 10))
    read = cache.read({P: [Due(T0 + 20, 1)]})  # the same slot, not the same record's time
    assert list(read) == [] and read.missing() == {P: [1]}
    cache.close()


def test_hits_come_in_key_order_misses_are_left_for_the_log(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "cache", horizon_ms=10_000)
    put(cache, T0, (1, T0 + 500), (2, T0 + 200), (3, T0 + 20_000), (4, T0 + 200))
    read = cache.read({P: [Due(T0 + 200, 2), Due(T0 + 200, 4), Due(T0 + 500, 1), Due(T0 + 20_000, 3)],
                       ("other", 0): [Due(T0 + 300, 9)]})  # fmt: skip
    got = [(offset, r.value()) for _, offset, r in read]
    assert got == [(2, b"v2"), (4, b"v4"), (1, b"v1")]  # 3 was beyond the horizon: never cached
    assert read.missing() == {P: [3], ("other", 0): [9]}
    assert read.hits == {"orders": 3}
    cache.close()


def test_a_sparse_request_over_a_full_range_still_finds_everything(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "cache", budget=1 << 30)
    put(cache, T0, *[(i, T0 + i) for i in range(30_000)])
    read = cache.read({P: [Due(T0, 0), Due(T0 + 29_999, 29_999)]})
    assert [offset for _, offset, _ in read] == [0, 29_999]  # the second by key, after the scan gave up
    assert read.missing() == {}
    cache.close()


def test_delete_before_frees_whole_seconds(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "cache")
    put(cache, T0, (1, T0 + 100), (2, T0 + 1100), (3, T0 + 1900))
    used = cache.budget.used
    cache.delete_before(T0 + 1500)  # deletes T0's second only: 2 shares its second with pending 3
    assert list(cache.read({P: [Due(T0 + 100, 1), Due(T0 + 1100, 2)]})) != []
    assert [o for _, o, _ in cache.read({P: [Due(T0 + 100, 1)]})] == []
    assert 0 < cache.budget.used < used
    cache.close()


def test_over_budget_entries_are_not_cached(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "cache", budget=300)
    put(cache, T0, *[(i, T0 + i * SLOT_MS) for i in range(10)])  # one entry each
    read = cache.read({P: [Due(T0 + i * SLOT_MS, i) for i in range(10)]})
    found = [o for _, o, _ in read]
    assert 0 < len(found) < 10 and cache.budget.used <= 300
    assert sorted(found + read.missing()[P]) == list(range(10))
    cache.close()


def test_a_clean_close_keeps_entries_and_byte_counts(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "cache")
    put(cache, T0, (1, T0 + 100))
    used = cache.budget.used
    cache.close()
    again = open_cache(tmp_path / "cache")
    assert again.budget.used == used
    assert [o for _, o, _ in again.read({P: [Due(T0 + 100, 1)]})] == [1]
    again.close()


@pytest.mark.parametrize("spoil", ["another owner", "a crash", "garbage"])
def test_an_unusable_cache_is_dropped_at_start(spoil: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache"
    owner = OWNER
    if spoil == "a crash":
        code = (
            "import os, sys; from pathlib import Path; sys.path.insert(0, '.');"
            "from tests.dispatch.test_payload_cache import open_cache, put, T0;"
            f"c = open_cache(Path({str(path)!r})); put(c, T0, (1, T0 + 100)); c._db.flush(); os._exit(0)"
        )
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
    else:
        cache = open_cache(path)
        put(cache, T0, (1, T0 + 100))
        cache.close()
        if spoil == "garbage":
            (path / "CURRENT").write_text("not a manifest\n")
        else:
            owner = "cluster-2/delay-sidecar"
    cache = open_cache(path, owner=owner)
    assert cache.budget.used == 0
    assert [o for _, o, _ in cache.read({P: [Due(T0 + 100, 1)]})] == []
    assert any("payload cache" in r.message and "drop" in r.message for r in caplog.records), caplog.text
    cache.close()


def test_budget_zero_means_no_cache(tmp_path: Path) -> None:
    assert PayloadCache.open(tmp_path / "cache", owner=OWNER, budget_bytes=0, horizon_ms=1) is None
    assert not (tmp_path / "cache").exists()
