"""Which class-sharing flags a Kafka JVM gets, and what becomes of an archive a JVM wrote (no JVM
here: tests/broker/test_apache.py has the real one)."""

import os
import time
from pathlib import Path

import pytest

from sidecar.broker.class_archive import STALE_S, ClassArchive


@pytest.fixture
def archive(tmp_path: Path) -> ClassArchive:
    return ClassArchive(tmp_path)


def test_without_an_archive_a_broker_writes_one_and_a_tool_neither_writes_nor_maps(archive: ClassArchive) -> None:
    flags, partial = archive.flags(["-XX:TieredStopAtLevel=1"], writer=True)
    assert partial is not None and partial.parent == archive.path.parent and not partial.exists()
    assert flags == [f"-XX:ArchiveClassesAtExit={partial}"]
    assert archive.flags([], writer=False) == ([], None)


def test_with_an_archive_every_jvm_maps_it_and_none_writes(archive: ClassArchive) -> None:
    archive.path.write_bytes(b"x")
    for writer in (True, False):
        assert archive.flags([], writer) == ([f"-XX:SharedArchiveFile={archive.path}"], None)


@pytest.mark.parametrize("own", ["-Xshare:off", "-XX:SharedArchiveFile=/opt/k.jsa", "-XX:ArchiveClassesAtExit=/x"])
def test_the_operator_s_own_sharing_flags_win(archive: ClassArchive, own: str) -> None:
    assert archive.flags(["-Xmx1g", own], writer=True) == ([], None)
    archive.path.write_bytes(b"x")
    assert archive.flags([own], writer=False) == ([], None)


def test_no_jvm_is_asked_to_write_an_archive_it_would_refuse_to_start_with(archive: ClassArchive) -> None:
    """Without compressed class pointers the JDK's base archive does not load, and a JVM told to
    write an archive then fails to start ("DynamicDumpSharedSpaces is unsupported when base CDS
    archive is not loaded"): the real JVM is asked, with the node's own options."""
    assert archive.flags(["-Xmx256m", "-XX:-UseCompressedClassPointers"], writer=True) == ([], None)
    flags, partial = archive.flags(["-Xmx256m"], writer=True)
    assert partial is not None and flags == [f"-XX:ArchiveClassesAtExit={partial}"]
    archive.path.write_bytes(b"x")  # mapping one is never refused at start: the JVM goes on without it
    mapped = [f"-XX:SharedArchiveFile={archive.path}"]
    assert archive.flags(["-XX:-UseCompressedClassPointers"], writer=False) == (mapped, None)


def test_a_clean_exit_keeps_what_the_jvm_wrote_and_a_kill_removes_it(archive: ClassArchive) -> None:
    _, partial = archive.flags([], writer=True)
    assert partial is not None
    partial.write_bytes(b"half")
    archive.settle(partial, -9)  # killed, perhaps while writing
    assert not partial.exists() and not archive.path.exists()
    _, partial = archive.flags([], writer=True)
    assert partial is not None
    archive.settle(partial, 143)  # ended without writing it
    assert not archive.path.exists()
    partial.write_bytes(b"whole")
    archive.settle(partial, 143)  # SIGTERM, as `stop` ends a node: the JVM writes on its way out
    assert archive.path.read_bytes() == b"whole" and not partial.exists()


def test_partial_archives_of_killed_writers_are_swept_once_stale(archive: ClassArchive) -> None:
    folder = archive.path.parent
    old, recent = folder / f"{archive.path.name}.1-1.tmp", folder / f"{archive.path.name}.2-2.tmp"
    old.write_bytes(b"old")
    recent.write_bytes(b"recent")
    past = time.time() - STALE_S - 10
    os.utime(old, (past, past))
    archive.flags([], writer=True)
    assert not old.exists() and recent.exists()


def test_each_jdk_installation_has_an_archive_of_its_own(tmp_path: Path) -> None:
    jdk = tmp_path / "jdk" / "bin"
    jdk.mkdir(parents=True)
    java = jdk / "java"
    java.write_text("#!/bin/sh\n")
    java.chmod(0o755)
    first = ClassArchive(tmp_path, str(java)).path
    assert first.name.startswith("classes-") and first.suffix == ".jsa"
    assert ClassArchive(tmp_path, str(java)).path == first
    os.utime(java, (1, 1))  # another build in the same place
    assert ClassArchive(tmp_path, str(java)).path != first
    assert ClassArchive(tmp_path).path != first
