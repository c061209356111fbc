"""One SparkSession for every Spark test (local[2], 4 shuffle partitions: the machine is shared)."""

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from spark.session import build_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session("local[2]", "delay-sidecar-audit-tests", shuffle_partitions=4)
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
