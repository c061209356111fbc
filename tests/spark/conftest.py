"""One SparkSession for every Spark test (local[2], 4 shuffle partitions: the machine is shared).

It is built as the audit builds its own, with Spark's Kafka connector on the class path (fetched
once into the cache, spark.connector): jars are read only when the JVM starts, so the tests that
read with the built-in source could not add it later.
"""

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from spark.session import build_session

NO_UI = {"spark.ui.enabled": "false"}
"""No web UI in the suite's sessions: nobody looks at it, and its listener takes CPU from the two
cores (the audit-logic and order tests: 53-57 s of CPU without it, 58-61 s with it)."""


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session("local[2]", "delay-sidecar-audit-tests", shuffle_partitions=4, conf=NO_UI)
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
