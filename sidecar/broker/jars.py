"""Apache Kafka's jars from Maven Central, fetched once into a cache folder and reused.

The release tarball's scripts only start classes from these jars, so the broker needs no download
of its own: `mvn dependency:copy-dependencies` on a one-dependency pom gives the class path. The
folder is complete only once a stamp file is written, so an interrupted fetch is redone, not used.
"""

import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from sidecar.broker.lifeline import die_with_parent
from sidecar.errors import BrokerError

logger = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"
"""Pinned: the suite, the benchmarks and the default broker all run this one."""
LOG4J_VERSION = "2.24.3"
"""The release's own binding for SLF4J 1.7 (Kafka 4 logs through Log4j 2)."""
CACHE_ENV = "DELAY_SIDECAR_CACHE_DIR"
STAMP = "complete"
FETCH_TIMEOUT_S = 900.0
MIN_JAVA = 17

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>delay-sidecar</groupId><artifactId>kafka-broker-jars</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>{kafka}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>{log4j}</version></dependency>
  </dependencies>
</project>
"""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_UNREACHABLE = (
    "Could not transfer",
    "Unknown host",
    "Connection refused",
    "connect timed out",
    "No plugin found",
    "offline",
)
"""What Maven prints when its repository cannot be reached, rather than lacking the artifact."""


def _is_reason(line: str) -> bool:
    text = line.removeprefix("[ERROR]").strip()
    return line.startswith("[ERROR]") and bool(text) and not text.startswith(("To see", "Re-run", "For more", "[Help"))


def cache_root() -> Path:
    """Where fetched jars live: $DELAY_SIDECAR_CACHE_DIR, else the user's cache (~/.cache/delay-sidecar)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "delay-sidecar"


def kafka_libs(version: str = KAFKA_VERSION) -> Path:
    return cache_root() / f"kafka-{version}" / "libs"


def java_major(java: str = "java") -> int | None:
    """The major version `java -version` reports; None when there is no java on PATH."""
    if shutil.which(java) is None:
        return None
    try:
        done = subprocess.run([java, "-version"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr.decode(errors="replace"))
    if found is None:
        return None
    major = int(found[1])
    return int(found[2] or 0) if major == 1 else major


def missing_tools(version: str = KAFKA_VERSION) -> str | None:
    """What keeps Apache Kafka from running here, in words; None when it can run.

    Maven is needed only for a first fetch: with the jars already cached, Java alone is enough.
    """
    major = java_major()
    if major is None:
        return "no Java on PATH (Apache Kafka needs Java 17 or newer)"
    if major < MIN_JAVA:
        return f"Java {major} on PATH (Apache Kafka 4 needs Java 17 or newer)"
    if not (kafka_libs(version) / STAMP).is_file() and shutil.which("mvn") is None:
        return f"no Maven on PATH to fetch Apache Kafka {version} (and no cached copy in {kafka_libs(version).parent})"
    return None


def fetch_kafka(version: str = KAFKA_VERSION) -> Path:
    """The folder of Apache Kafka's jars, fetched with Maven on first use."""
    libs = kafka_libs(version)
    if (libs / STAMP).is_file():
        return libs
    if shutil.which("mvn") is None:
        raise BrokerError(
            f"Apache Kafka {version} is not cached in {libs} and there is no Maven on PATH to fetch it; install "
            f"Maven (Debian: apt-get install maven), or use --broker-kind noida-db"
        )
    libs.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching Apache Kafka with Maven version=%s into=%s", version, libs)
    with tempfile.TemporaryDirectory(dir=libs.parent, prefix=".fetch-") as work:
        pom = Path(work) / "pom.xml"
        pom.write_text(_POM.format(kafka=version, log4j=LOG4J_VERSION))
        target = Path(work) / "libs"
        command = [
            "mvn",
            "-B",
            "-q",
            "-Dstyle.color=never",
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={target}",
        ]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                timeout=FETCH_TIMEOUT_S,
                check=False,
                preexec_fn=die_with_parent(),
            )
        except subprocess.TimeoutExpired:
            raise BrokerError(
                f"Maven did not fetch Apache Kafka {version} within {FETCH_TIMEOUT_S:.0f}s: is its repository "
                f"reachable? Or fill {libs} by hand with the jars of org.apache.kafka:kafka_2.13:{version} and "
                f"their dependencies, then create the file {libs / STAMP}"
            ) from None
        if done.returncode != 0 or not any(target.glob("kafka_2.13-*.jar")):
            output = _ANSI.sub("", (done.stdout + done.stderr).decode(errors="replace"))
            reasons = [line.removeprefix("[ERROR]").strip() for line in output.splitlines() if _is_reason(line)]
            unreachable = any(mark in output for mark in _UNREACHABLE)
            what = "could not reach its repository to fetch" if unreachable else "could not fetch"
            raise BrokerError(
                f"Maven {what} org.apache.kafka:kafka_2.13:{version} (exit {done.returncode}: "
                f"{' | '.join(reasons[:2]) or 'no error printed'}). Fill {libs} by hand with that artifact's jars and "
                f"their dependencies (a release tarball's libs/ folder will do), then create the file "
                f"{libs / STAMP}; or use --broker-kind noida-db"
            )
        if libs.exists():
            shutil.rmtree(libs)
        target.rename(libs)
    (libs / STAMP).write_text(f"org.apache.kafka:kafka_2.13:{version}\n")
    logger.info("fetched Apache Kafka version=%s jars=%d", version, len(list(libs.glob("*.jar"))))
    return libs
