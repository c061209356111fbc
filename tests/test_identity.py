"""Who a sidecar is to Kafka: distinct, stable transactional ids, and one live process per identity."""

import fcntl
import itertools
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO, Any

import pytest

from sidecar.app import member_instance_id, transactional_ids
from sidecar.cli import main
from sidecar.errors import ConfigError, StorageError
from sidecar.identity import IDS_FILE, LOCK_FILE, InstanceLock, TransactionalIds
from sidecar.settings import ENV_PREFIX, RunSettings
from sidecar.supervisor import Supervisor, worker_environment
from tests.kafka_helpers import PolicyFile, SidecarProcess, run_args, wait_for


def test_each_producer_gets_an_id_never_used_before_and_fences_the_ones_left_open(tmp_path: Path) -> None:
    ids = TransactionalIds("g-me", tmp_path)
    first, earlier = ids.next()
    assert earlier == [] and first.startswith("g-me-")
    second, earlier = ids.next()  # an engine that failed: its producer may hold an open transaction
    assert second != first and earlier == [first]
    ids.ended(earlier)
    again = TransactionalIds("g-me", tmp_path)  # a restart reads the list back
    third, earlier = again.next()
    assert earlier == [second] and third not in (first, second)
    again.ended([third])  # a clean stop: nothing left to fence
    assert TransactionalIds("g-me", tmp_path).next()[1] == [second]


def test_ids_stay_unique_when_the_clock_is_behind_the_last_one(tmp_path: Path) -> None:
    future = time.time_ns() // 1_000_000 + 3_600_000
    (tmp_path / IDS_FILE).write_text(json.dumps({"prefix": "g-me", "last": future, "open": []}))
    fresh, _ = TransactionalIds("g-me", tmp_path).next()
    assert fresh == f"g-me-{future + 1}"


def test_an_unreadable_ids_file_starts_a_new_list(tmp_path: Path) -> None:
    (tmp_path / IDS_FILE).write_text("{not json")
    fresh, earlier = TransactionalIds("g-me", tmp_path).next()
    assert earlier == [] and json.loads((tmp_path / IDS_FILE).read_text())["open"] == [fresh]


def test_an_unwritable_state_dir_is_a_storage_error_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / IDS_FILE).mkdir()  # the file cannot be replaced
    with pytest.raises(StorageError, match="record its transactional ids"):
        TransactionalIds("g-me", tmp_path).next()


def test_owns_tells_this_identitys_ids_from_others() -> None:
    ids = TransactionalIds("g-host-1")
    assert ids.owns("g-host-1-1795583863394")
    assert not ids.owns("g-host-12-1795583863394") and not ids.owns("g-host-1") and not ids.owns("g-default")


def test_a_second_lock_on_the_state_dir_or_the_identity_is_refused_until_the_first_ends(tmp_path: Path) -> None:
    first = InstanceLock(tmp_path / "a", "g", "one")
    with pytest.raises(ConfigError, match=f"in use by another running sidecar \\(pid {os.getpid()}\\)"):
        InstanceLock(tmp_path / "a", "g", "two")
    with pytest.raises(ConfigError, match="already runs as instance 'one' in group 'g'"):
        InstanceLock(tmp_path / "b", "g", "one")
    InstanceLock(tmp_path / "c", "other-group", "one").close()  # another group: another identity
    first.close()
    InstanceLock(tmp_path / "b", "g", "one").close()


def identity_lock_files() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("delay-sidecar-*.lock"))


def test_a_clean_close_removes_the_identity_s_lock_file_and_keeps_the_state_dir_s(tmp_path: Path) -> None:
    before = identity_lock_files()
    lock = InstanceLock(tmp_path / "a", "g", f"one-{uuid.uuid4()}")
    [created] = identity_lock_files() - before
    lock.close()
    assert not created.exists() and (tmp_path / "a" / LOCK_FILE).exists()


def test_a_lock_file_removed_between_its_open_and_its_flock_is_opened_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a removable lock file opens: C opens A's file, A closes (removing it), B makes and
    locks a new one, and only then does C's flock, on A's old file, succeed. C must see that the
    path names another file now, open that one, and be refused: B holds it."""
    identity = f"one-{uuid.uuid4()}"
    first = InstanceLock(tmp_path / "a", "g", identity)
    flock = fcntl.flock
    raced: list[InstanceLock | None] = []

    def racing(handle: IO[str], flags: int) -> None:
        if not raced and Path(handle.name).parent == Path(tempfile.gettempdir()):
            raced.append(None)
            first.close()
            raced[0] = InstanceLock(tmp_path / "b", "g", identity)
        flock(handle, flags)

    monkeypatch.setattr(fcntl, "flock", racing)
    with pytest.raises(ConfigError, match=f"already runs as instance '{identity}'.*pid {os.getpid()}"):
        InstanceLock(tmp_path / "c", "g", identity)
    monkeypatch.undo()
    [second] = raced
    assert second is not None
    second.close()


def _instances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, workers: int, **common: object
) -> list[RunSettings]:
    """The settings each process ends up with: two sidecars named by `source`, each with `workers`."""
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    out = []
    for name in ("alpha", "beta"):
        values: dict[str, object] = {"state_dir": tmp_path / name, "workers": workers, **common}
        if source == "flag":
            values["instance_id"] = name
        elif source == "env":
            monkeypatch.setenv(ENV_PREFIX + "INSTANCE_ID", name)
        settings = RunSettings(**values)  # type: ignore[arg-type]
        monkeypatch.delenv(ENV_PREFIX + "INSTANCE_ID", raising=False)
        if workers == 1:
            out.append(settings)
            continue
        env = worker_environment(settings)
        for i in range(workers):  # what each worker reads: its environment, then its command line
            argv = Supervisor(settings)._worker(i, "k:9092", []).argv
            flags = dict(zip(argv[4::2], argv[5::2], strict=False))
            with monkeypatch.context() as m:
                for key, value in env.items():
                    if key.startswith(ENV_PREFIX):
                        m.setenv(key, value)
                out.append(RunSettings(instance_id=flags["--instance-id"], state_dir=Path(flags["--state-dir"])))
    return out


@pytest.mark.parametrize(
    ("protocol", "leave", "workers", "source"),
    list(itertools.product([None, "SASL_SSL"], [False, True], [1, 2], ["flag", "env", "state-dir"])),
)
def test_every_instance_gets_a_distinct_stable_transactional_id(
    protocol: str | None, leave: bool, workers: int, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a secured cluster with --leave-group-on-stop gave every instance `<group>-default`."""
    common = {"security_protocol": protocol, "leave_group_on_stop": leave, "processing_guarantee": "exactly-once"}
    first = _instances(tmp_path, monkeypatch, source, workers, **common)
    again = _instances(tmp_path, monkeypatch, source, workers, **common)
    prefixes = []
    for settings in first:
        ids = transactional_ids(settings)
        assert ids is not None
        prefixes.append(ids.prefix)
        assert "default" not in ids.prefix
    assert len(set(prefixes)) == len(prefixes) == 2 * workers, prefixes  # distinct
    assert prefixes == [transactional_ids(s).prefix for s in again]  # type: ignore[union-attr]  # stable
    dynamic = leave and protocol == "SASL_SSL"
    assert all((member_instance_id(s) is None) == dynamic for s in first)  # the member id may go, the identity stays


class _Built(BaseException):
    """Raised by the writer's own producer: the path from the command line has reached it."""


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict[str, Any]]]:
    """The config of each Producer the writer creates, and of the engine's Consumer, recorded instead
    of connecting (there is no SASL_SSL cluster here). The writer's own producer ends the run."""
    made: dict[str, list[dict[str, Any]]] = {"writer": [], "fence": [], "consumer": []}

    class Producer:
        def __init__(self, config: dict[str, Any], logger: object = None) -> None:
            own = "on_delivery" in config  # the writer's own producer; a fence's has no delivery callback
            made["writer" if own else "fence"].append(dict(config))
            if own:
                raise _Built

        def init_transactions(self, timeout: float) -> None:
            """A fence opens the earlier id once."""

    class Consumer:
        def __init__(self, config: dict[str, Any], logger: object = None) -> None:
            made["consumer"].append(dict(config))

        def close(self) -> None:
            """Closed by the engine when its writer could not be built."""

    monkeypatch.setattr("sidecar.outbound.writer.Producer", Producer)
    monkeypatch.setattr("sidecar.inbound.member.Consumer", Consumer)
    # What asks the cluster before the engine is built: its metadata, and its id for the state's owner.
    monkeypatch.setattr("sidecar.broker.external.wait_for_metadata", lambda *args, **kwargs: None)
    monkeypatch.setattr("sidecar.app.state_owner", lambda settings, config: f"secured/{settings.group_id}")
    # Signal handlers and the root logger are this pytest process's: left alone.
    monkeypatch.setattr("sidecar.cli.run_until_signalled", lambda app: app.run())
    monkeypatch.setattr("sidecar.cli.setup_logging", lambda level: None)
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    return made


def test_instances_on_a_sasl_ssl_cluster_leaving_on_stop_give_their_producers_distinct_ids_and_the_credentials(
    producers: dict[str, list[dict[str, Any]]], policy_file: PolicyFile, tmp_path: Path
) -> None:
    """`delay-sidecar run` from its command line (sidecar/cli.py) through SidecarApp and the engine to
    the writer, for two instances on one host: what the Producer is created with. The settings-level
    test above compares prefixes; this is the transactional.id the broker would see. A restart of
    one instance gets a new id (one per producer, identity.py) with the same prefix, and fences the
    id of the incarnation before it first."""
    policies = policy_file("allow_empty: true\ntopics: {}\n")
    ca = tmp_path / "ca.pem"
    ca.write_text("")  # only passed on: nothing connects
    secured = {"bootstrap.servers": "kafka.example:9093", "security.protocol": "SASL_SSL",
               "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "sidecar", "sasl.password": "s3cret",
               "ssl.ca.location": str(ca)}  # fmt: skip

    def run(instance: str) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        """(the writer's producer config, the engine's consumer config, the fences' configs)."""
        for made in producers.values():
            made.clear()
        with pytest.raises(_Built):
            main(["run", "--bootstrap-servers", secured["bootstrap.servers"], "--security-protocol", "SASL_SSL",
                  "--sasl-mechanism", "SCRAM-SHA-512", "--sasl-username", "sidecar", "--sasl-password", "s3cret",
                  "--ssl-ca-location", str(ca), "--leave-group-on-stop", "--processing-guarantee", "exactly-once",
                  "--group-id", "orders", "--state-dir", str(tmp_path / instance), "--policies", str(policies),
                  "--metrics-port", "0", "--tracker", "memory", "--payload-cache-bytes", "0"])  # fmt: skip
        [writer], [consumer] = producers["writer"], producers["consumer"]
        return writer, consumer, list(producers["fence"])

    alpha, alpha_consumer, alpha_fenced = run("alpha")
    beta, _, _ = run("beta")
    again, _, again_fenced = run("alpha")  # a restart of alpha, on its state dir

    ids = [config["transactional.id"] for config in (alpha, beta, again)]
    prefixes = [i.rpartition("-")[0] for i in ids]
    assert ids[0] != ids[1] and prefixes[0] != prefixes[1], ids  # two instances: two identities
    assert all(p.startswith("orders-") and "default" not in p for p in prefixes), ids
    assert prefixes[2] == prefixes[0] and ids[2] != ids[0], ids  # the same identity, a new producer's id
    assert alpha_fenced == [] and [f["transactional.id"] for f in again_fenced] == [ids[0]]
    for config in (alpha, beta, again, *again_fenced):
        assert {key: config.get(key) for key in secured} == secured, config
    assert "group.instance.id" not in alpha_consumer, "leave-group-on-stop on SASL_SSL: a dynamic member"
    assert {key: alpha_consumer.get(key) for key in secured} == secured


def test_two_processes_with_one_identity_are_refused_at_start(
    kafka: str, policy_file: PolicyFile, tmp_path: Path
) -> None:
    """The same state dir, or the same --instance-id: the second process exits with an error that
    says what to change; after a kill -9 of the first, its restart is not refused."""
    policies = policy_file("allow_empty: true\ntopics: {}\n")
    same_id = ("--instance-id", "twin", "--processing-guarantee", "exactly-once")
    first = SidecarProcess(run_args(kafka, policies, tmp_path / "one", 0, "g-twins", *same_id), tmp_path / "1.log")
    shared_dir = SidecarProcess(run_args(kafka, policies, tmp_path / "one", 0, "g-twins"), tmp_path / "2.log")
    shared_id = SidecarProcess(run_args(kafka, policies, tmp_path / "two", 0, "g-twins", *same_id), tmp_path / "3.log")
    try:
        first.start()
        wait_for(lambda: "partitions assigned" in first.log.read_text(), 60, "the first sidecar to serve")
        for second, says in ((shared_dir, "is in use by another running sidecar"),
                             (shared_id, "already runs as instance 'twin'")):  # fmt: skip
            assert second.start().process is not None
            assert second.process.wait(60) == 2, second.tail()
            assert says in second.log.read_text() and "Traceback" not in second.log.read_text()
        first.kill()
        first.start()
        wait_for(lambda: first.log.read_text().count("partitions assigned") >= 2, 60, "the restart to serve")
        assert first.stop() == 0
    finally:
        for process in (first, shared_dir, shared_id):
            process.close()
