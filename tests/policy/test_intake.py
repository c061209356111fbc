"""judge(): the one decision of a record's fate, pure, for live intake and rebuild alike."""

from hypothesis import given
from hypothesis import strategies as st

from sidecar.durations import MAX_EPOCH_MS
from sidecar.policy.intake import Fate, Judge, judge
from sidecar.policy.model import EffectiveDelay, Sourced
from sidecar.policy.routes import IntakeRule

PUBLISH = 1_700_000_000_000


def rule(enabled: bool = True, fixed: int = 0, max_ms: int = 0, retention: int | None = None,
         delayed: tuple[str, ...] = ("a",)) -> IntakeRule:  # fmt: skip
    delay = EffectiveDelay(Sourced(enabled, "topic"), Sourced(max_ms, "topic"), Sourced(fixed, "topic"))
    return IntakeRule(delay, retention, delayed)


def test_no_header_is_delivered_now() -> None:
    assert judge(rule(), None, PUBLISH).deliver_at is None


def test_a_delay_header_delays_for_the_subscriptions_that_honour_it() -> None:
    fate = judge(rule(), [("deliver-after", b"5s")], PUBLISH)
    assert fate.deliver_at == PUBLISH + 5_000 and fate.rejected is None


def test_without_subscriptions_that_honour_delays_everything_goes_now() -> None:
    assert judge(rule(delayed=()), [("deliver-after", b"5s")], PUBLISH).deliver_at is None


def test_rejections_carry_their_code() -> None:
    assert outcome(judge(rule(), [("deliver-after", b"soon")], PUBLISH)) == (None, "INVALID_DELAY_HEADER")
    over = judge(rule(max_ms=1_000), [("deliver-after", b"5s")], PUBLISH).rejected
    assert over is not None and over.code == "EXCEEDS_MAX_DELAY"
    kept = judge(rule(retention=1_000), [("deliver-after", b"5s")], PUBLISH).rejected
    assert kept is not None and kept.code == "EXCEEDS_RETENTION"


def test_fixed_delay_overrides_and_disabled_is_counted() -> None:
    fixed = judge(rule(fixed=2_000), [("deliver-after", b"5s")], PUBLISH)
    assert fixed.deliver_at == PUBLISH + 2_000 and fixed.overridden
    disabled = judge(rule(enabled=False), [("deliver-after", b"5s")], PUBLISH)
    assert disabled.deliver_at is None and disabled.disabled


def outcome(fate: Fate) -> tuple[int | None, str | None]:
    return fate.deliver_at, fate.rejected.code if fate.rejected is not None else None


def test_a_recorded_rule_judges_as_the_live_one_did() -> None:
    live = rule(fixed=0, max_ms=60_000, retention=86_400_000, delayed=("a", "b"))
    decoded = IntakeRule.decode(live.encode(42))
    assert decoded is not None
    offset, recorded = decoded
    assert offset == 42 and recorded.key == live.key
    for headers in ([("deliver-after", b"5s")], [("deliver-after", b"2m")], None, [("deliver-at", b"x")]):
        assert outcome(judge(recorded, headers, PUBLISH)) == outcome(judge(live, headers, PUBLISH))


@given(
    st.booleans(),
    st.integers(0, 100_000),
    st.integers(0, 100_000),
    st.one_of(st.none(), st.integers(-1, 100_000)),
    st.sampled_from([(), ("a",)]),
    st.integers(1, 2**42),
)
def test_the_shortcut_for_records_without_headers_decides_as_judge(
    enabled: bool, fixed: int, max_ms: int, retention: int | None, delayed: tuple[str, ...], publish: int
) -> None:
    r = rule(enabled, fixed, max_ms, retention, delayed)
    shortcut, full = Judge(), judge(r, None, publish)
    assert outcome(shortcut(r, None, publish)) == outcome(full)
    assert outcome(shortcut(r, None, publish + 7)) == outcome(judge(r, None, publish + 7))  # from the memo
    headers = [("deliver-after", b"5s")]
    assert outcome(shortcut(r, headers, publish)) == outcome(judge(r, headers, publish))


HEADER_VALUES = st.one_of(
    st.integers(0, 10**13).map(lambda n: str(n).encode()),
    st.sampled_from([b"250ms", b"5s", b"2m", b"3h", b"7d", b"-1", b"soon", b"", b"2026-11-25T10:00:00Z"]),
    st.binary(max_size=12),
)
HEADERS = st.one_of(
    st.none(),
    st.lists(
        st.tuples(st.sampled_from(["deliver-at", "deliver-after", "Deliver-At", "trace", "DELIVER-AFTER"]),
                  st.one_of(st.none(), HEADER_VALUES)),
        max_size=3,
    ),
)  # fmt: skip


@given(
    st.booleans(),
    st.integers(0, 100_000),
    st.integers(0, 100_000),
    st.one_of(st.none(), st.integers(-1, 100_000)),
    st.sampled_from([(), ("a",), ("a", "b")]),
    st.lists(st.tuples(HEADERS, st.integers(1, 2**42)), max_size=30),
)
def test_judging_a_batch_gives_each_record_the_fate_judging_it_alone_gives(
    enabled: bool,
    fixed: int,
    max_ms: int,
    retention: int | None,
    delayed: tuple[str, ...],
    records: list[tuple[list[tuple[str, bytes | None]] | None, int]],
) -> None:
    """Judge.many is the intake's batch path; judge is what a rebuild and a drain call per record."""
    r = rule(enabled, fixed, max_ms, retention, delayed)
    batch = Judge().many(r, records)
    alone = [judge(r, headers, publish) for headers, publish in records]
    assert [f._replace(rejected=None) for f in batch] == [f._replace(rejected=None) for f in alone]
    assert [f.rejected and (f.rejected.code, str(f.rejected)) for f in batch] == [
        f.rejected and (f.rejected.code, str(f.rejected)) for f in alone
    ]


def assert_judged_alike(r: IntakeRule, name: str, value: bytes, publish: int) -> None:
    """Judge's shortcut, alone and in a batch, gives judge's fate, and any rejection's code and words."""
    headers = [(name, value)]
    expected = judge(r, headers, publish)
    for fate in (Judge()(r, headers, publish), Judge().many(r, [(headers, publish)])[0]):
        assert fate._replace(rejected=None) == expected._replace(rejected=None)
        assert (fate.rejected and (fate.rejected.code, str(fate.rejected))) == (
            expected.rejected and (expected.rejected.code, str(expected.rejected))
        )


@given(
    st.booleans(),
    st.sampled_from(["max", "retention", "fixed", "publish", "year 9999"]),
    st.integers(1, 10**12),
    st.integers(-1, 1),
    st.sampled_from([(), ("a",)]),
    st.sampled_from(["deliver-at", "deliver-after"]),
    st.integers(1, 2**42),
)
def test_one_delay_header_of_digits_is_judged_as_judge_would_at_each_limit(
    enabled: bool, limit: str, size: int, step: int, delayed: tuple[str, ...], name: str, publish: int
) -> None:
    """The shortcut for the common header, a millisecond either side of each limit it checks."""
    r = rule(
        enabled,
        fixed=size % 100_000 if limit == "fixed" else 0,
        max_ms=size if limit == "max" else 0,
        retention=size if limit == "retention" else None,
        delayed=delayed,
    )
    delay = {"max": size, "retention": size, "fixed": size % 100_000, "publish": 0}.get(limit)
    at = MAX_EPOCH_MS + step if delay is None else publish + max(delay + step, 0)
    assert_judged_alike(r, name, str(at - publish if name == "deliver-after" else at).encode(), publish)


@given(
    st.booleans(),
    st.one_of(st.just(0), st.integers(0, 100_000)),
    st.one_of(st.just(0), st.integers(0, 10**12)),
    st.one_of(st.none(), st.integers(-1, 10**12)),
    st.sampled_from([(), ("a",)]),
    st.sampled_from(["deliver-at", "deliver-after"]),
    st.one_of(
        st.integers(0, 10**19).map(lambda n: str(n).encode()),
        st.integers(0, 10**6).map(lambda n: b"000" + str(n).encode()),
        st.binary(max_size=20),
    ),
    st.integers(1, 2**42),
)
def test_one_delay_header_of_any_value_is_judged_as_judge_would(
    enabled: bool,
    fixed: int,
    max_ms: int,
    retention: int | None,
    delayed: tuple[str, ...],
    name: str,
    value: bytes,
    publish: int,
) -> None:
    """Past 18 digits, with leading zeros, or not digits at all."""
    assert_judged_alike(rule(enabled, fixed, max_ms, retention, delayed), name, value, publish)
