"""A class-data sharing archive of Apache Kafka's classes (JDK 13+ dynamic AppCDS), beside the jars.

A node spends most of its start loading and verifying the same few thousand classes from the jars.
The JVM can keep them, parsed and verified, in an archive that later JVMs map: a node's start and
stop took 2.2 s of CPU instead of 3.4 s here, and it answered after 2.1 s instead of 3.3 s
(docs/development.md). So the first node that stops cleanly writes the archive as it exits
(-XX:ArchiveClassesAtExit), and every node after it maps it (-XX:SharedArchiveFile).

The archive is an optimisation the JVM checks, never a condition: one written by another JDK, or
damaged, is refused by the JVM (-Xshare:auto, its default), which then loads the classes as
usual. Its name carries the JDK's path and build time, so that an upgraded JDK writes its own.
Writing one is another matter: a JVM asked to write an archive whose JDK's own base archive does
not load with its options (a JDK without one, or -XX:-UseCompressedClassPointers) refuses to
start. So a writer is asked for only where `java -Xshare:on -version`, with the same options,
says the base archive loads.
An operator who passes any -Xshare or archive flag of their own in KAFKA_OPTS or
KAFKA_JVM_PERFORMANCE_OPTS gets those instead.
"""

import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)

OWN_FLAGS = ("-Xshare", "SharedArchiveFile", "ArchiveClassesAtExit")
"""JVM options that mean the operator chose class sharing themselves."""
STALE_S = 3600.0
"""A partial archive this old was left by a JVM killed while it wrote: removed."""


class ClassArchive:
    """One JDK's archive of the classes of one Kafka release's jars, in that release's cache folder."""

    def __init__(self, folder: Path, java: str = "java") -> None:
        self.path = folder / f"classes-{_jdk_fingerprint(java)}.jsa"
        self._java = java
        self._base_loads: dict[tuple[str, ...], bool] = {}

    def flags(self, options: list[str], writer: bool) -> tuple[list[str], Path | None]:
        """The JVM options to add, and the file a writer will leave when it exits cleanly (None: it
        writes nothing). `options`: the JVM's others, the operator's included. `writer`: the JVM is
        a broker, whose classes are the ones to keep (a tool would keep only its own)."""
        if any(flag in option for option in options for flag in OWN_FLAGS):
            return [], None
        if self.path.is_file():
            return [f"-XX:SharedArchiveFile={self.path}"], None
        if not writer or not self._base_archive_loads(options):
            return [], None
        self._sweep()
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}-{time.monotonic_ns()}.tmp")
        return [f"-XX:ArchiveClassesAtExit={partial}"], partial

    def settle(self, partial: Path, exit_code: int) -> None:
        """After a writer's exit: its archive becomes the archive if the JVM ended by itself (it writes
        the file on the way out), and is removed if it was killed, perhaps while writing it."""
        try:
            if exit_code >= 0 and partial.is_file() and partial.stat().st_size > 0:
                partial.replace(self.path)  # atomic: a JVM starting now maps the old one or this one
                logger.info("broker class archive written path=%s bytes=%d", self.path, self.path.stat().st_size)
            else:
                partial.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("broker class archive not kept path=%s error=%s", partial, exc)

    def _base_archive_loads(self, options: list[str]) -> bool:
        """Asked of the JVM once per set of options: whether its base archive loads with them."""
        key = tuple(options)
        if key not in self._base_loads:
            try:
                done = subprocess.run(
                    [self._java, *options, "-Xshare:on", "-version"], capture_output=True, timeout=60, check=False
                )
                loads = done.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                loads = False
            if not loads:
                logger.info("broker class archive not written: the JDK's base archive does not load with these "
                            "options, and the JVM would refuse to start options=%s", " ".join(options))  # fmt: skip
            self._base_loads[key] = loads
        return self._base_loads[key]

    def _sweep(self) -> None:
        for stale in self.path.parent.glob(f"{self.path.name}.*.tmp"):
            try:
                if time.time() - stale.stat().st_mtime > STALE_S:
                    stale.unlink()
            except OSError:
                continue


def _jdk_fingerprint(java: str) -> str:
    """Short, and different for each JDK installation and each build of it."""
    found = shutil.which(java)
    if found is None:
        return "nojava"
    binary = Path(found).resolve()
    try:
        built = binary.stat().st_mtime_ns
    except OSError:
        built = 0
    return hashlib.sha1(f"{binary}\n{built}".encode()).hexdigest()[:12]
