"""The key=value log line, and the worker index `run --workers N` adds to each of its workers' lines."""

import logging

import pytest

from sidecar.logs import WORKER_ENV, KeyValueFormatter, setup_logging


def line(formatter: logging.Formatter, message: str, *args: object) -> str:
    record = logging.LogRecord("sidecar.engine", logging.INFO, __file__, 1, message, args, None)
    return formatter.format(record)


def test_the_leading_words_are_the_event_and_the_pairs_follow() -> None:
    text = line(KeyValueFormatter(), 'partitions "assigned" partitions=%s n=%d', ["t/0"], 1)
    assert text.endswith("""level=INFO logger=sidecar.engine event="partitions 'assigned'" partitions=['t/0'] n=1""")


def test_a_worker_s_lines_end_with_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    assert line(KeyValueFormatter("3"), "stopped").endswith('event="stopped" worker=3')
    assert line(KeyValueFormatter("0"), "stopped reason=%s", "x").endswith('event="stopped" reason=x worker=0')
    monkeypatch.setenv(WORKER_ENV, "1")
    root = logging.getLogger()
    kept = root.handlers[:], root.level
    try:
        setup_logging("INFO")
        [handler] = root.handlers
        assert handler.formatter is not None and line(handler.formatter, "ready").endswith("worker=1")
        monkeypatch.delenv(WORKER_ENV)
        setup_logging("INFO")
        assert root.handlers[0].formatter is not None
        assert line(root.handlers[0].formatter, "ready").endswith('event="ready"')
    finally:
        root.handlers[:] = kept[0]
        root.setLevel(kept[1])
