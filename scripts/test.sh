#!/usr/bin/env bash
# The whole test suite: lint, types, the docs site, then every test against Apache Kafka, then the
# tests marked `fallback` against noida-db, the broker the sidecar falls back to on a machine without
# Java.
# Needs Python 3.11+, Java 17+ and Maven (Apache Kafka's jars are fetched once, into
# ~/.cache/delay-sidecar). KAFKA_BOOTSTRAP_SERVERS runs the first part on a cluster of yours instead.
set -euo pipefail
# The suite starts some 250 Python processes (sidecars, workers, benches) and each pytest worker
# collects every test file. With PYTHONDONTWRITEBYTECODE in the environment (set on the machines CI
# runs on) none of them could cache its bytecode: each compiled the package again (a sidecar's
# first 6 s took 0.67 to 0.71 s of CPU, 0.50 to 0.59 s with the cache), and each worker rewrote
# every test file (a collection took 4.6 to 6.1 s of CPU, 2.4 to 3.0 s with the cache): some 60 s
# of CPU a run. The caches go to __pycache__ (gitignored).
unset PYTHONDONTWRITEBYTECODE
source "$(dirname "$0")/bootstrap.sh" "dev,spark,docs"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The docs site: a broken link, a page missing from the nav or a reference page that no longer
# matches the code (docs/hooks/reference.py) is a warning, and --strict makes it a failure.
# NO_MKDOCS_2_WARNING silences the theme's notice about its own end of life, printed on every build.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
# Four workers on the two cores (the tests wait on brokers, timers and group rebalances more than
# they compute), a test file each at a time so module fixtures stay in one process; the Spark test
# files go to one worker together, and at most two units that start clusters, JVMs or several
# brokers run at once (tests/conftest.py). Six workers took the broker phase from 900 to 680 s, but
# with the cores saturated a failover test's sidecar lost its group session while one node was away
# (docs/development.md). The workers share one Apache Kafka node, started by the controlling pytest
# process, which prints its version in the header.
if [ $# -gt 0 ]; then
  exec .venv/bin/pytest -n 4 --dist loadfile "$@"
fi
# First the tests that need no broker (under a minute), stopping at the first failure; then the rest.
# Three workers: on two, the cores were idle 40% of the phase (the policy watcher's tests wait for
# files to settle); three took 51 to 53 s against 65 to 69 s, by turns on a quiet machine.
.venv/bin/pytest -n 3 --dist loadfile -m "not broker" -x
.venv/bin/pytest -n 4 --dist loadfile -m broker
# The fallback keeps working: a small set on noida-db, an embedded broker per worker. Four workers:
# on three the cores were idle 50 to 90% of this phase (its tests wait on kills and restarts).
exec env DELAY_SIDECAR_TEST_BROKER=noida-db .venv/bin/pytest -n 4 --dist loadfile -m fallback
