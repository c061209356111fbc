#!/usr/bin/env bash
# The whole test suite: lint, types, then every test against a real broker (KAFKA_BOOTSTRAP_SERVERS,
# else a testcontainers apache/kafka when Docker answers, else the embedded broker). The Spark audit's
# tests need Java 17 (PySpark runs it).
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh" "dev,spark"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# Four workers on the two cores (the tests wait on brokers, timers and group rebalances more than
# they compute: three workers kept the cores about half busy), a test file each at a time so module
# fixtures stay in one process; the Spark test files go to one worker together (tests/conftest.py),
# which is then the longest. Each worker starts its own embedded broker. `-n 0` runs in one process.
exec .venv/bin/pytest -n 4 --dist loadfile "$@"
