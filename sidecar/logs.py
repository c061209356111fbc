"""Logging as key=value lines, one per event, so they can be grepped and parsed.

Messages are written as "what happened key=value key=value"; the formatter turns the leading
words into event="what happened" and prefixes time, level and logger.
"""

import logging
import os
import re
import sys

_FIRST_PAIR = re.compile(r"\s(?=[A-Za-z_][\w.]*=)")


WORKER_ENV = "DELAY_SIDECAR_LOG_WORKER"
"""Set by `run --workers N` for each worker (its index): every line the worker logs ends with
`worker=<i>`, so the workers' lines, which share the supervisor's stderr, can be told apart."""


class KeyValueFormatter(logging.Formatter):
    def __init__(self, worker: str | None = None) -> None:
        super().__init__()
        self._suffix = f" worker={worker}" if worker else ""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        parts = _FIRST_PAIR.split(message, maxsplit=1)
        event = parts[0].replace('"', "'")
        pairs = f" {parts[1]}" if len(parts) > 1 else ""
        stamp = f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')}.{int(record.msecs):03d}"
        line = f'ts={stamp} level={record.levelname} logger={record.name} event="{event}"{pairs}{self._suffix}'
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(os.environ.get(WORKER_ENV)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
