"""Spark's Kafka connector (spark-sql-kafka-0-10 of the installed Spark), fetched once and cached.

Fetched before the JVM starts, not with `spark.jars.packages`: Spark resolves packages on every
start, and a failed resolution kills that start (JAVA_GATEWAY_EXITED), which leaves no session to
fall back to the Python source in. Here a failed fetch is an exception the session builder can
turn into "read with the Python source"; once cached, a start reads nothing from the network.

The fetch runs the Ivy jar Spark ships, with the module and exclusions `--packages` uses, so the
same jars come. Only the configured repository is asked: Spark's default chain looks in ~/.m2
first and gives up at a pom there whose jar is absent (what a Maven build that needed only the pom
leaves), even when the repository behind it has the jar.

The folder is complete only once a stamp file is written, so an interrupted fetch is redone, not
used; a lock lets concurrent processes (test workers) fetch once between them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import quoteattr

from sidecar.broker.jars import cache_root
from sidecar.broker.lifeline import die_with_parent
from sidecar.errors import SidecarError

logger = logging.getLogger(__name__)

ARTIFACT = "spark-sql-kafka-0-10"
DEFAULT_REPOSITORY = "https://repo1.maven.org/maven2/"
STAMP = "complete"
FETCH_TIMEOUT_S = 900.0
CONNECT_TIMEOUT_MS = 30_000
READ_TIMEOUT_MS = 120_000

SPARK_COMPONENTS = (
    "catalyst|core|graphx|kvstore|launcher|mllib|mllib-local|network-common|network-shuffle|repl|sketch|sql|"
    "streaming|tags|unsafe"
)
"""Spark's own modules, which `--packages` leaves out of a resolution (they are in Spark's jars/)."""

_IVY_SETTINGS = """<ivysettings>
  <settings defaultResolver="repository"/>
  <timeout-constraints>
    <timeout-constraint name="bounded" connectionTimeout="{connect}" readTimeout="{read}"/>
  </timeout-constraints>
  <resolvers>
    <ibiblio name="repository" m2compatible="true" root={root} timeoutConstraint="bounded"/>
  </resolvers>
</ivysettings>
"""

_IVY_MODULE = """<ivy-module version="2.0">
  <info organisation="delay-sidecar" module="spark-kafka-connector"/>
  <configurations><conf name="default"/></configurations>
  <dependencies>
    <dependency org="org.apache.spark" name="{artifact}_{scala}" rev="{version}" conf="default->default(runtime)"/>
    <exclude org="*" module="scala-library"/>
    <exclude org="org.apache.spark" module="spark-({components})_.*" matcher="regexp"/>
  </dependencies>
</ivy-module>
"""

_SERVER_ERROR = re.compile(r"Server access error at url (?P<url>\S+) \((?P<why>[^)]*)\)")
_HOST_NOT_FOUND = re.compile(r"Host (?P<host>\S+) not found")
_NOT_FOUND = re.compile(r"::\s+(?P<module>\S+;\S+): not found")


class ConnectorUnavailable(SidecarError):
    """Spark's Kafka connector is neither cached nor fetchable; `reason` is the short why, for reports."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class SparkBuild:
    """The Spark that a session of this interpreter starts: its jars decide the connector's version."""

    version: str
    scala: str
    home: Path

    @property
    def coordinate(self) -> str:
        return f"org.apache.spark:{ARTIFACT}_{self.scala}:{self.version}"


def installed_spark() -> SparkBuild:
    """Read from the spark-core jar's name, without starting a JVM (SPARK_HOME wins, as for pyspark)."""
    import pyspark  # noqa: PLC0415 (the settings import this module's names without Spark)
    from pyspark.find_spark_home import _find_spark_home  # noqa: PLC0415

    home = Path(_find_spark_home())
    for jar in sorted((home / "jars").glob("spark-core_*.jar")):
        found = re.fullmatch(r"spark-core_(?P<scala>\d+\.\d+)-(?P<version>.+)\.jar", jar.name)
        if found:
            return SparkBuild(found["version"], found["scala"], home)
    return SparkBuild(pyspark.__version__, "2.13", home)


def connector_dir(build: SparkBuild) -> Path:
    return cache_root() / f"{ARTIFACT}_{build.scala}-{build.version}"


def cached_jars(build: SparkBuild) -> list[Path] | None:
    folder = connector_dir(build)
    return sorted(folder.glob("*.jar")) if (folder / STAMP).is_file() else None


def connector_jars(repository: str = DEFAULT_REPOSITORY, build: SparkBuild | None = None) -> list[Path]:
    """The connector's jars and those of its dependencies Spark lacks; fetched on first use."""
    build = build or installed_spark()
    jars = cached_jars(build)
    if jars is not None:
        return jars
    folder = connector_dir(build)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{folder.name}.lock"):
        jars = cached_jars(build)  # another process fetched it while this one waited
        if jars is not None:
            return jars
        return _fetch(build, repository, folder)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def java_command() -> str:
    """The java Spark's launcher runs: $JAVA_HOME/bin/java, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    return str(Path(home) / "bin" / "java") if home else "java"


def _fetch(build: SparkBuild, repository: str, folder: Path) -> list[Path]:
    coordinate = build.coordinate
    by_hand = (
        f"or put the jars of {coordinate} and of its dependencies that Spark lacks (kafka-clients, commons-pool2, "
        f"spark-token-provider-kafka-0-10) in {folder} and create the file {folder / STAMP}, or pass them with "
        f"--jars; --source python reads without the connector"
    )
    ivy = sorted((build.home / "jars").glob("ivy-*.jar"))
    java = java_command()
    if not ivy:
        raise ConnectorUnavailable(
            f"cannot fetch Spark's Kafka connector {coordinate}: Spark at {build.home} has no Ivy jar to fetch "
            f"it with; {by_hand}",
            f"no Ivy jar in {build.home / 'jars'}",
        )
    if shutil.which(java) is None:
        raise ConnectorUnavailable(
            f"cannot fetch Spark's Kafka connector {coordinate}: no {java} to run Ivy with (Spark needs Java 17 too)",
            f"no {java}",
        )
    root = repository if repository.endswith("/") else repository + "/"
    logger.info("fetching spark kafka connector coordinate=%s repository=%s into=%s", coordinate, root, folder)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-") as work_dir:
        work = Path(work_dir)
        (work / "ivysettings.xml").write_text(
            _IVY_SETTINGS.format(root=quoteattr(root), connect=CONNECT_TIMEOUT_MS, read=READ_TIMEOUT_MS)
        )
        (work / "ivy.xml").write_text(
            _IVY_MODULE.format(artifact=ARTIFACT, scala=build.scala, version=build.version, components=SPARK_COMPONENTS)
        )
        target = work / "jars"
        command = [
            java,
            f"-Divy.default.ivy.user.dir={work / 'ivy-home'}",  # nothing of this fetch lands in ~/.ivy2
            "-jar",
            str(ivy[-1]),
            "-settings",
            str(work / "ivysettings.xml"),
            "-cache",
            str(work / "cache"),
            "-ivy",
            str(work / "ivy.xml"),
            "-confs",
            "default",
            "-retrieve",
            f"{target}/[artifact]-[revision](-[classifier]).[ext]",
            "-warn",
        ]
        try:
            done = subprocess.run(
                command, capture_output=True, timeout=FETCH_TIMEOUT_S, check=False, preexec_fn=die_with_parent()
            )
        except subprocess.TimeoutExpired:
            raise ConnectorUnavailable(
                f"Ivy did not fetch Spark's Kafka connector {coordinate} from {root} within {FETCH_TIMEOUT_S:.0f}s: "
                f"is it reachable? Give another Maven repository with --connector-repository URL, {by_hand}",
                f"fetch from {root} timed out after {FETCH_TIMEOUT_S:.0f}s",
            ) from None
        main = target / f"{ARTIFACT}_{build.scala}-{build.version}.jar"
        if done.returncode != 0 or not main.is_file():
            reason = ivy_failure(
                (done.stdout + done.stderr).decode(errors="replace"), root, done.returncode, main.is_file()
            )
            raise ConnectorUnavailable(
                f"cannot fetch Spark's Kafka connector {coordinate}: {reason}. Give a reachable Maven repository "
                f"with --connector-repository URL (or DELAY_SIDECAR_CONNECTOR_REPOSITORY), {by_hand}",
                reason,
            )
        # Jars Spark ships already (hadoop-client-*, lz4, snappy, slf4j...) would only be loaded twice.
        shipped = {jar.name for jar in (build.home / "jars").glob("*.jar")}
        for jar in target.glob("*.jar"):
            if jar.name in shipped:
                jar.unlink()
        (target / STAMP).write_text(f"{coordinate}\nfrom {root}\n")
        if folder.exists():  # an interrupted fetch of an older tree (no stamp: never used)
            shutil.rmtree(folder)
        target.rename(folder)
    jars = sorted(folder.glob("*.jar"))
    logger.info(
        "fetched spark kafka connector coordinate=%s jars=%d seconds=%.1f",
        coordinate,
        len(jars),
        time.monotonic() - started,
    )
    return jars


def ivy_failure(output: str, root: str, exit_code: int, retrieved: bool) -> str:
    """Why Ivy failed, in one line: the repository unreachable, or the module not in it."""
    server = _SERVER_ERROR.search(output)
    if server:
        return f"{root} unreachable ({server['why']})"
    host = _HOST_NOT_FOUND.search(output)
    if host:
        return f"{root} unreachable (host {host['host']} not found)"
    missing = _NOT_FOUND.search(output)
    if missing:
        return f"{missing['module'].replace('#', ':').replace(';', ':')} not found in {root}"
    if exit_code == 0 and not retrieved:
        return f"Ivy retrieved no connector jar from {root}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return f"Ivy exited {exit_code} ({lines[-1][:300] if lines else 'no error printed'})"
