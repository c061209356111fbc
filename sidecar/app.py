"""Wiring: a cluster from a launcher, the policies, the trackers, the loop and the status endpoint."""

import faulthandler
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

from confluent_kafka.admin import AdminClient

from sidecar.broker import BrokerLauncher, EmbeddedBroker, ExternalBroker, local_broker
from sidecar.clock import Clock, SystemClock
from sidecar.control.cancels import key_fields
from sidecar.dispatch.payload_cache import PayloadCache
from sidecar.engine import Sidecar
from sidecar.errors import BrokerError, ConfigError, SidecarError
from sidecar.group_leave import leave_group
from sidecar.http import StatusServer
from sidecar.identity import InstanceLock, TransactionalIds
from sidecar.kafka_io import LIBRDKAFKA
from sidecar.metrics import BucketMetrics, Metrics
from sidecar.partitions.lookup import Asked
from sidecar.partitions.owner import client_id, find_owner, nacks_body, with_members_nacks
from sidecar.policy import PolicySet
from sidecar.policy.commands import effective_policy_json
from sidecar.policy.reload import PolicyWatcher, ReloadResult
from sidecar.settings import RunSettings, default_instance_id
from sidecar.state.mirror import MirroredStorage
from sidecar.tracker import DelayedDeliveryTracker, InMemoryTracker
from sidecar.tracker.bucket import BucketTracker
from sidecar.tracker.storage import RocksDbSnapshotStorage, SnapshotStorage

logger = logging.getLogger(__name__)

# Pause before the engine is built again after a failure, doubling up to the max.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


def launcher_for(settings: RunSettings, stop: threading.Event | None = None) -> BrokerLauncher:
    """The cluster the settings name, or a local broker under the state dir when they name none."""
    if settings.bootstrap_servers:
        return ExternalBroker(settings.bootstrap_servers, settings.client_config(settings.bootstrap_servers), stop)
    return local_broker(settings.broker_kind, None, port=settings.broker_port, state_dir=settings.state_dir)


EMBEDDED_IDLE_FETCH_PAUSE_MS = 10


def idle_fetch_pause_ms(asked: int | None, launcher: BrokerLauncher) -> int:
    """The idle-fetch pause asked for (--idle-fetch-pause-ms), else the one the broker needs
    (inbound/idle_fetch.py): noida-db answers an empty fetch at once, Apache Kafka holds it. Of a
    cluster it did not start, the sidecar cannot tell which."""
    if asked is not None:
        return asked
    return EMBEDDED_IDLE_FETCH_PAUSE_MS if isinstance(launcher, EmbeddedBroker) else 0


STATE_TAIL_OFFSETS = 10_000
"""With a state topic, the mutable bucket is sealed at a checkpoint once its first offset is this far
behind the cursor: a new owner then reads about this much of the log again (docs/scaling.md: 0 to
1.4% of a partition's 83,000 pending records with it, 40% with the default buckets of 50,000)."""


def tracker_factory(
    settings: RunSettings, clock: Clock, storage: SnapshotStorage | None, metrics: Metrics
) -> Callable[[str, int], DelayedDeliveryTracker]:
    """One tracker per inbound partition, all over one snapshot store (control partitions: engine.py)."""
    listener = BucketMetrics(metrics)

    def create(topic: str, partition: int) -> DelayedDeliveryTracker:
        if storage is None:
            return InMemoryTracker(clock)
        return BucketTracker(
            clock,
            storage,
            f"{topic}/{partition}",
            min_index_count=settings.bucket_min_index_count,
            time_step_ms=settings.bucket_time_step_ms,
            max_indexes_per_segment=settings.bucket_max_indexes_per_segment,
            max_buckets=settings.bucket_max_buckets,
            listener=listener,
            # With a state topic, what a new owner reads again is the unsealed tail: keep it short.
            seal_behind=min(settings.bucket_min_index_count, STATE_TAIL_OFFSETS) if settings.state_topic_name else None,
        )

    return create


def member_instance_id(settings: RunSettings) -> str | None:
    """The static member id, or None to join as a dynamic member.

    A planned leave of a static member needs a plain connection to the coordinator (group_leave.py);
    on a secured cluster --leave-group-on-stop makes the sidecar a dynamic member instead, whose
    close sends LeaveGroup through librdkafka. It then loses the fast takeover after a restart.
    """
    if settings.leave_group_on_stop and settings.security_protocol not in (None, "PLAINTEXT"):
        return None
    return instance_identity(settings)


def instance_identity(settings: RunSettings) -> str:
    """Who this process is, static member or not: it prefixes the transactional ids (identity.py)."""
    return settings.instance_id or default_instance_id(settings.state_dir)


def transactional_ids(settings: RunSettings) -> TransactionalIds | None:
    """Exactly-once mode: the source of this process's transactional ids, `<group>-<identity>-<n>`."""
    if settings.processing_guarantee != "exactly-once":
        return None
    return TransactionalIds(f"{settings.group_id}-{instance_identity(settings)}", settings.state_dir)


def state_owner(settings: RunSettings, client_config: dict[str, Any]) -> str:
    """Who the state dir's stores belong to: this cluster and consumer group.

    The owner check refuses (index) or drops (payload cache) state written for another cluster or
    group, which would describe offsets of a different log.
    """
    cluster = AdminClient(client_config, logger=LIBRDKAFKA).list_topics(timeout=10).cluster_id or "unknown-cluster"
    return f"{cluster}/{settings.group_id}"


def open_snapshot_storage(settings: RunSettings, owner: str) -> SnapshotStorage | None:
    """The bucket tracker's RocksDB under the state dir, mirrored to the state topic if there is one."""
    if settings.tracker != "bucket":
        return None
    local = RocksDbSnapshotStorage(settings.state_dir / "index", owner=owner)
    return MirroredStorage(local) if settings.state_topic_name else local


def open_payload_cache(settings: RunSettings, owner: str) -> PayloadCache | None:
    """The payload cache's own RocksDB under the state dir (None with --payload-cache-bytes 0).

    Never a reason not to start: a cache that cannot be used is dropped or left out, and payloads
    are read back from the log.
    """
    return PayloadCache.open(
        settings.state_dir / "cache",
        owner=owner,
        budget_bytes=settings.payload_cache_bytes,
        horizon_ms=settings.payload_cache_horizon_ms,
    )


def effective_policy(policies: PolicySet, topic: str) -> dict[str, Any]:
    try:
        return effective_policy_json(policies, topic)
    except ConfigError as e:
        return {"topic": topic, "error": str(e)}


class SidecarApp:
    """The sidecar as a process runs it; the demo and the tests run it on a thread."""

    def __init__(self, settings: RunSettings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.metrics = Metrics()
        self.sidecar: Sidecar | None = None
        self.status: StatusServer | None = None
        self.policies: PolicyWatcher | None = None
        self._stop = threading.Event()
        self._recovering: str | None = None

    def stop(self) -> None:
        self._stop.set()
        if self.sidecar is not None:
            self.sidecar.stop()

    def run(self) -> None:
        settings = self.settings
        self.policies = policies = PolicyWatcher(Path(settings.policies), listeners=[self._on_reload])
        self.metrics.policy_reloads.labels("ok").inc()
        with ExitStack() as stack:
            identity = instance_identity(settings)
            stack.callback(InstanceLock(settings.state_dir, settings.group_id, identity).close)
            policies.start()
            stack.callback(policies.stop)
            launcher = launcher_for(settings, self._stop)
            bootstrap = launcher.start()
            stack.callback(launcher.stop)
            if self._stop.is_set():
                return
            client_config = settings.client_config(bootstrap)
            if settings.metrics_port:  # the message lookup finds a partition's owner by it (partitions/owner.py)
                client_config.setdefault("client.id", client_id(settings.metrics_port))
            owner = state_owner(settings, client_config)
            storage = open_snapshot_storage(settings, owner)
            if storage is not None:
                stack.callback(storage.close)
            payload_cache = open_payload_cache(settings, owner)
            if payload_cache is not None:
                stack.callback(payload_cache.close)
            instance_id = member_instance_id(settings)
            ids = transactional_ids(settings)
            if settings.leave_group_on_stop and instance_id is None:
                logger.warning(
                    "leave-group-on-stop on a %s cluster: joining as a dynamic member, so a restart "
                    "rebalances the group instead of taking the partitions back at once",
                    settings.security_protocol,
                )
            if settings.monotone_runs:
                logger.warning(
                    "--monotone-runs is ignored: monotone runs were removed, the index is faster and "
                    "later by less on Apache Kafka (docs, Tuning); drop the flag"
                )

            def build() -> Sidecar:  # one engine per attempt, see _serve
                return Sidecar(
                    client_config,
                    policies=policies.get,
                    tracker_factory=tracker_factory(settings, self.clock, storage, self.metrics),
                    group_id=settings.group_id,
                    instance_id=instance_id,
                    session_timeout_ms=settings.session_timeout_ms,
                    metrics=self.metrics,
                    clock=self.clock,
                    commit_interval_ms=settings.commit_interval_ms,
                    batch_size=settings.batch_size,
                    idle_fetch_pause_ms=idle_fetch_pause_ms(settings.idle_fetch_pause_ms, launcher),
                    new_topic_partitions=settings.new_topic_partitions,
                    replication_factor=settings.replication_factor,
                    control_topic=settings.control_topic,
                    read_ahead_ms=settings.read_ahead_ms,
                    recent_records_bytes=settings.recent_records_bytes,
                    payload_cache=payload_cache,
                    outbound_headers=settings.outbound_headers,
                    producer={"compression.type": settings.compression_type, "linger.ms": settings.linger_ms},
                    assignment_strategy=settings.assignment_strategy,
                    transactional_ids=ids,
                    state_topic=settings.state_topic_name,
                    index_storage=storage,
                    state_dir=settings.state_dir,
                )

            if settings.metrics_port:
                self.status = StatusServer(
                    settings.metrics_host,
                    settings.metrics_port,
                    self.metrics.registry,
                    health=self._health,
                    policy=lambda topic: effective_policy(policies.current, topic),
                    message=functools.partial(self._where_is, client_config),
                )
                self.status.start()
                stack.callback(self.status.stop)
            self._serve(build)
            if settings.leave_group_on_stop and instance_id is not None:
                self._leave(bootstrap, instance_id)

    def _where_is(
        self, client_config: dict[str, Any], topic: str, partition: int, asked: Asked, scope: str | None
    ) -> tuple[int, dict[str, Any]]:
        """GET /messages/{topic}/{partition}/{offset} (or ?key= of a keyed topic): the owner answers,
        with the nacks the other members hold; another member names the owner. `scope=member`: this
        member's nacks only."""
        sidecar = self.sidecar
        if sidecar is None or not sidecar.running:
            return 503, {"error": "not serving yet; ask again shortly"}
        try:
            found = sidecar.where_is(topic, partition, asked)
        except TimeoutError:
            return 503, {"error": "the sidecar is busy; ask again shortly"}
        except SidecarError as e:
            return 503, {"error": str(e)}
        named = {"offset": asked} if isinstance(asked, int) else key_fields(asked)
        about = {"topic": topic, "partition": partition, **named}
        if scope == "member":
            return 200, {**about, "nacks": nacks_body(found)}
        group = self.settings.group_id
        answer = found.answer
        if answer is not None and "offset" in answer:
            return 200, with_members_nacks(client_config, group, found, topic, partition, answer["offset"])
        if answer is not None:  # a key the partition has no record of
            return 200, answer
        return 200, {**about, "state": "not-owner", "owner": find_owner(client_config, group, topic, partition)}

    def _leave(self, bootstrap: str, instance_id: str) -> None:
        """After the last checkpoint is committed: hand this member's partitions to the others now."""
        try:
            leave_group(bootstrap, self.settings.group_id, instance_id)
        except BrokerError as e:
            logger.error("leaving the consumer group failed error=%s", str(e).replace("\n", " "))

    def _serve(self, build: Callable[[], Sidecar]) -> None:
        """Run the engine; when it fails (a fatal client error, a broker gone for good), drop it and
        build a new one that starts again from the last checkpoint, after a growing pause.

        Everything the failed engine did after its last checkpoint is simply done again: the
        recovery paths that serve a restart serve here too, without the process going away.
        """
        backoff = RESTART_BACKOFF_S
        while not self._stop.is_set():
            started = time.monotonic()
            sidecar: Sidecar | None = None
            try:
                # Building is part of the attempt: in exactly-once mode it fences the earlier
                # transactional.id, which fails while the brokers are still away.
                self.sidecar = sidecar = build()
                if self._stop.is_set():
                    return
                sidecar.run()
                return
            except ConfigError:
                raise
            except Exception as e:
                if self._stop.is_set():
                    return
                served = sidecar is not None and sidecar.assigned.is_set()
                if served or time.monotonic() - started > RESTART_BACKOFF_MAX_S:
                    backoff = RESTART_BACKOFF_S  # it got as far as serving: this is a new fault
                self.metrics.engine_restarts.inc()
                self._recovering = f"recovering from {type(e).__name__}: {e}"
                logger.error(
                    "engine failed; starting again from the last checkpoint error_type=%s error=%s retry_in_s=%.1f",
                    type(e).__name__,
                    str(e).replace("\n", " "),
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)

    def wait_serving(self, timeout_s: float) -> bool:
        """True once the sidecar holds inbound partitions; for the demo and tests."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sidecar = self.sidecar
            if sidecar is not None and sidecar.assigned.wait(0.05):
                return True
            time.sleep(0.05)
        return False

    def reload_policies(self) -> None:
        """SIGHUP: reload now rather than at the next poll. Safe in a signal handler."""
        if self.policies is not None:
            self.policies.request_reload()

    def _on_reload(self, result: ReloadResult) -> None:
        self.metrics.policy_reloads.labels(result.result).inc()
        if result.ok:
            logger.info(
                "policies reloaded generation=%d trigger=%s changes=%s", result.generation, result.trigger, result.diff
            )
        else:
            logger.error(
                "policy reload failed; generation %d stays in force trigger=%s error=%s",
                result.generation,
                result.trigger,
                result.error,
            )

    def _health(self) -> tuple[bool, list[str], dict[str, Any]]:
        details: dict[str, Any] = {}
        if self.policies is not None:
            details["policy_generation"] = self.policies.generation
            if self.policies.last_error is not None:
                # Still ready: the last good generation keeps serving. The operator must fix the file.
                details["policy_error"] = str(self.policies.last_error)
        sidecar = self.sidecar
        if sidecar is None:
            return False, [self._recovering or "starting"], details
        if self._recovering is not None and not sidecar.running:
            return False, [self._recovering], details
        if sidecar.degraded:
            details["degraded"] = list(sidecar.degraded)
        reasons = list(sidecar.not_ready_reasons)
        return sidecar.running and not reasons, reasons, details


class Signalled(Protocol):
    def run(self) -> None: ...
    def stop(self) -> None: ...
    def reload_policies(self) -> None: ...


def run_until_signalled(app: Signalled) -> None:
    """Run in the main thread; SIGTERM and Ctrl-C stop cleanly (a sidecar with a last checkpoint,
    a supervisor with its workers), SIGHUP reloads the policies."""

    def on_signal(signum: int, frame: object) -> None:
        logger.info("stopping signal=%s", signal.Signals(signum).name)
        app.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda signum, frame: app.reload_policies())
    # A hang's evidence: every thread's stack to stderr, written by the signal handler itself, so it
    # works while the main thread is stuck in the Kafka client's C code.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    app.run()
