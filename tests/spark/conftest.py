"""One SparkSession for every Spark test (local[2], 4 shuffle partitions: the machine is shared).

It is built as the audit builds its own, with Spark's Kafka connector on the class path (fetched
once into the cache, spark.connector): jars are read only when the JVM starts, so the tests that
read with the built-in source could not add it later.
"""

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from spark.session import build_session

SUITE_CONF = {"spark.ui.enabled": "false", "spark.driver.extraJavaOptions": "-XX:+UseSerialGC"}
"""The suite's sessions are small and share two cores with everything else:
- no web UI: nobody looks at it, and its listener takes CPU (the audit-logic and order tests: 53-57 s
  of CPU without it, 58-61 s with it);
- the serial collector: G1's concurrent threads cost more than they save on a heap this small (the
  same tests, the JVM's CPU and pytest's: 68.7 and 61.8 s against 76.7 and 73.7 with G1, run by
  turns on a quiet machine, 2026-11-30). Only C1 (-XX:TieredStopAtLevel=1) cost more, 86.6 s, and
  so did no whole-stage code generation, 77.9 s."""


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session("local[2]", "delay-sidecar-audit-tests", shuffle_partitions=4, conf=SUITE_CONF)
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(autouse=True, scope="module")
def released_caches() -> Iterator[None]:
    """A module's audits (spark.audit.run_audit) leave their results cached for its tests to read;
    once the module is done they go, so the session's heap does not grow file after file (the audit
    job releases its own: AuditResult.release). No session is started for a module without one."""
    yield
    session = SparkSession.getActiveSession()
    if session is not None:
        session.catalog.clearCache()
