#!/usr/bin/env bash
# The whole test suite: lint, types, then every test against a real broker (KAFKA_BOOTSTRAP_SERVERS,
# else a testcontainers apache/kafka when Docker answers, else the embedded broker). The Spark audit's
# tests need Java 17 (PySpark runs it).
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh" "dev,spark"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# Two workers, a test file each at a time (module fixtures such as a Spark session stay in one
# process); each worker starts its own embedded broker. `-n 0` runs in one process.
exec .venv/bin/pytest -n 2 --dist loadfile "$@"
