"""PolicyWatcher: edits take effect once settled, bad or empty edits keep the last good generation."""

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.errors import ConfigError
from sidecar.policy import PolicyDiff, PolicyError, PolicyWatcher, ReloadResult, diff, load_policies
from sidecar.policy.loader import EMPTY_POLICY

WriteYaml = Callable[..., Path]

GOOD = "topics:\n  orders:\n    delayed_delivery:\n      max_delivery_delay: 1h\n    subscriptions:\n      a: {}\n"
EDITED = GOOD.replace("1h", "2h")
BROKEN = GOOD.replace("1h", "2 hours")


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> float:
    """Seconds it took for `condition` to hold; fails the test after timeout_s (a hang, not slowness).

    How fast an edit takes effect is a timing, measured outside the tests; here only that it does.
    """
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"not within {timeout_s}s")
        time.sleep(0.02)
    return time.monotonic() - start


def last_error(watcher: PolicyWatcher) -> ConfigError | None:
    """Read through a call: mypy would otherwise keep the type narrowed by an earlier isinstance."""
    return watcher.last_error


def max_ms(watcher: PolicyWatcher) -> int:
    return watcher.current.topics["orders"].delay.max_ms


def test_an_edit_takes_effect(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", GOOD)
    results: list[ReloadResult] = []
    with PolicyWatcher(path, listeners=[results.append]) as watcher:
        assert watcher.generation == 1
        write_yaml("p.yaml", EDITED)
        wait_for(lambda: max_ms(watcher) == 7_200_000)
    assert watcher.generation == 2
    assert watcher.last_error is None
    assert [(r.ok, r.result, r.trigger, r.generation) for r in results] == [(True, "ok", "poll", 2)]
    assert results[0].diff == PolicyDiff(changed_topics=("orders",))


def test_a_broken_edit_keeps_the_old_policy_and_names_file_and_key(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", GOOD)
    results: list[ReloadResult] = []
    with PolicyWatcher(path, listeners=[results.append]) as watcher:
        write_yaml("p.yaml", BROKEN)
        wait_for(lambda: bool(results))  # listeners run after last_error is set: wait for them
        assert max_ms(watcher) == 3_600_000
        assert watcher.generation == 1
        assert isinstance(watcher.last_error, PolicyError)
        (problem,) = watcher.last_error.problems
        assert (problem.file, problem.line, problem.key) == (
            str(path),
            4,
            "topics.orders.delayed_delivery.max_delivery_delay",
        )
        assert [(r.ok, r.result, r.generation) for r in results] == [(False, "error", 1)]
        assert results[0].problems == (problem,)
        time.sleep(1.2)  # the same broken content is not reported again and again
        assert len(results) == 1
        write_yaml("p.yaml", EDITED)  # fixing it clears the error and moves on one generation
        wait_for(lambda: watcher.generation == 2)
        assert last_error(watcher) is None
        assert max_ms(watcher) == 7_200_000


def test_a_directory_is_watched_for_added_and_removed_files(write_yaml: WriteYaml) -> None:
    a = write_yaml("policies/a.yaml", GOOD)
    with PolicyWatcher(a.parent, interval_s=0.1) as watcher:
        b = write_yaml("policies/b.yaml", "topics:\n  refunds:\n    subscriptions:\n      r: {}\n")
        wait_for(lambda: "refunds" in watcher.current.topics)
        assert watcher.generation == 2
        b.unlink()
        wait_for(lambda: "refunds" not in watcher.current.topics)
        assert watcher.generation == 3
        write_yaml("policies/c.yaml", "topics:\n  orders: {}\n")  # a duplicate: refused
        wait_for(lambda: watcher.last_error is not None)
        assert "topics.orders: already defined in" in str(watcher.last_error)
        assert watcher.generation == 3


def test_poll_without_a_thread_and_reload_now(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", GOOD)
    watcher = PolicyWatcher(path, settle_s=0)  # two looks in a row, however close
    assert watcher.poll() is None
    write_yaml("p.yaml", EDITED)
    assert watcher.poll() is None  # changed: waits one poll for the file to settle
    result = watcher.poll()
    assert result is not None and result.ok and watcher.generation == 2
    assert watcher.poll() is None
    forced = watcher.reload_now("signal")
    assert (forced.ok, forced.trigger, forced.generation) == (True, "signal", 3)
    assert forced.diff == PolicyDiff()
    assert not forced.diff


def test_request_reload_from_a_signal_handler(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", GOOD)
    done = threading.Event()
    watcher = PolicyWatcher(path, interval_s=30, listeners=[lambda r: done.set()])
    with watcher:
        watcher.request_reload()
        assert done.wait(30)
    assert watcher.generation == 2


def test_a_failing_listener_does_not_stop_reloads(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", GOOD)

    def broken(result: ReloadResult) -> None:
        raise RuntimeError("metrics down")

    seen: list[int] = []
    watcher = PolicyWatcher(path, listeners=[broken])
    watcher.add_listener(lambda r: seen.append(r.generation))
    assert watcher.reload_now().ok
    assert seen == [2]


def test_an_invalid_policy_at_start_is_an_error(write_yaml: WriteYaml) -> None:
    with pytest.raises(ConfigError):
        PolicyWatcher(write_yaml("p.yaml", BROKEN))


def test_a_deleted_file_keeps_the_policy(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", GOOD)
    watcher = PolicyWatcher(path)
    path.unlink()
    result = watcher.reload_now()
    assert not result.ok
    assert str(result.error) == f"{path}: policy file not found; pass --policies FILE_OR_DIR"
    assert max_ms(watcher) == 3_600_000


def test_diff(write_yaml: WriteYaml) -> None:
    old = load_policies(write_yaml("old.yaml", "topics:\n  a:\n    subscriptions: {x: {}, y: {}}\n  b: {}\n  c: {}\n"))
    new = load_policies(
        write_yaml(
            "new.yaml",
            "topics:\n  a:\n    subscriptions: {y: {}, z: {}}\n  b: {}\n"
            "  c:\n    delayed_delivery: {enabled: false}\n  d:\n    subscriptions: {w: {}}\n",
        )
    )
    assert diff(old, new) == PolicyDiff(
        added_topics=("d",),
        removed_topics=(),
        changed_topics=("a", "c"),
        added_subscriptions=(("a", "z"), ("d", "w")),
        removed_subscriptions=(("a", "x"),),
    )
    assert diff(new, new) == PolicyDiff()


def test_an_empty_save_is_refused_and_the_old_generation_stays(write_yaml: WriteYaml) -> None:
    """Issue 12: a save caught empty became generation 2 and unsubscribed every topic, silently."""
    path = write_yaml("p.yaml", GOOD)
    results: list[ReloadResult] = []
    with PolicyWatcher(path, interval_s=0.05, settle_s=0.2, listeners=[results.append]) as watcher:
        write_yaml("p.yaml", "")
        wait_for(lambda: bool(results))
        assert [(r.ok, r.result, r.generation) for r in results] == [(False, "error", 1)]
        assert watcher.generation == 1 and "orders" in watcher.current.topics
        assert str(watcher.last_error) == f"{path}: {EMPTY_POLICY}"
        write_yaml("p.yaml", "# nothing but a comment\ntopics: {}\n")  # no topics, not said on purpose
        wait_for(lambda: len(results) == 2)
        assert not results[1].ok and watcher.generation == 1


def test_allow_empty_removes_every_topic_on_purpose(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", GOOD)
    watcher = PolicyWatcher(path)
    write_yaml("p.yaml", "allow_empty: true\ntopics: {}\n")
    result = watcher.reload_now()
    assert result.ok and watcher.generation == 2
    assert result.diff == PolicyDiff(removed_topics=("orders",), removed_subscriptions=(("orders", "a"),))
    assert dict(watcher.current.topics) == {}


def test_an_empty_policy_at_start_is_refused(write_yaml: WriteYaml) -> None:
    with pytest.raises(PolicyError, match="allow_empty: true"):
        PolicyWatcher(write_yaml("p.yaml", "defaults:\n  delayed_delivery: {max_delivery_delay: 1h}\n"))
    assert PolicyWatcher(write_yaml("q.yaml", "allow_empty: true\n")).current.topics == {}


def test_a_half_written_save_is_never_loaded(write_yaml: WriteYaml) -> None:
    """Truncate, then write in two steps: only the finished file may become a generation.

    The steps are 0.1 s apart and the settle time is 5 s, so a loaded machine has seconds of slack.
    """
    path = write_yaml("p.yaml", GOOD)
    results: list[ReloadResult] = []
    with PolicyWatcher(path, interval_s=0.02, settle_s=5.0, listeners=[results.append]) as watcher:
        with path.open("w") as file:
            file.flush()
            time.sleep(0.1)  # empty, for several polls
            file.write("topics:\n  orders:\n")  # valid YAML: orders with no limit and no subscriptions
            file.flush()
            time.sleep(0.1)
            file.write(EDITED[len("topics:\n  orders:\n") :])
        wait_for(lambda: bool(results))
        assert [(r.ok, r.generation) for r in results] == [(True, 2)]
        assert max_ms(watcher) == 7_200_000


def test_a_sighup_waits_for_the_files_to_settle(write_yaml: WriteYaml) -> None:
    path = write_yaml("p.yaml", GOOD)
    results: list[ReloadResult] = []
    with PolicyWatcher(path, interval_s=30, settle_s=5.0, listeners=[results.append]) as watcher:
        path.write_text("")  # caught half-way by a SIGHUP sent right after the save started
        watcher.request_reload()
        time.sleep(0.1)
        write_yaml("p.yaml", EDITED)
        wait_for(lambda: bool(results))
        assert [(r.ok, r.trigger, r.generation) for r in results] == [(True, "signal", 2)]
        assert max_ms(watcher) == 7_200_000
