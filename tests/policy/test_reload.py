"""PolicyWatcher: edits take effect within 2 s, bad edits keep the last good generation."""

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.errors import ConfigError
from sidecar.policy import PolicyDiff, PolicyError, PolicyWatcher, ReloadResult, diff, load_policies

WriteYaml = Callable[..., Path]

GOOD = "topics:\n  orders:\n    delayed_delivery:\n      max_delivery_delay: 1h\n    subscriptions:\n      a: {}\n"
EDITED = GOOD.replace("1h", "2h")
BROKEN = GOOD.replace("1h", "2 hours")


def wait_for(condition: Callable[[], bool], timeout_s: float = 2.0) -> float:
    """Seconds it took for `condition` to hold; fails the test after timeout_s."""
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


def test_an_edit_takes_effect_within_two_seconds(write_yaml: WriteYaml) -> None:
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
    watcher = PolicyWatcher(path)
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
        assert done.wait(2)
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
