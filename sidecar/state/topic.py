"""The state topic: a consumer group's bucket snapshots in a compacted Kafka topic, for handoffs.

Kafka holds the index the way Kafka Streams holds a store's changelog and Pulsar holds bucket
snapshots in BookKeeper (PIP-195). A member that takes over a partition without usable local
state loads the partition's manifest and sealed buckets from here and reads the inbound log again
only from the manifest's tail, instead of from the earliest pending record. A control partition's
pending nacks are here the same way (control/nacks.py keeps their changelog).

Writes happen at the checkpoint (checkpoint.py), for each partition whose layout changed: the
buckets sealed or merged since the last one, then the manifest, then tombstones for the buckets
deleted. (A control partition's new nack chunks may also go between checkpoints, without a
manifest: `journal`, state/journal.py.) One state partition holds all of an inbound partition's
records, so a reader sees them in that order and a manifest never names a bucket that is not
there yet. In exactly-once mode they are written by the transactional producer, so the manifest,
the snapshots and the committed offsets become visible together.

Why a manifest can trail the commit and still be right: it says that every indexed entry below
its tail is in its buckets or was delivered. Reading the log again from there (or from the
committed offset, if that comes first) re-indexes the rest; entries the buckets already hold are
not indexed twice (`tracker.add` checks), and the commit's watermark says what was delivered.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from sidecar.broker.admin import TopicAdmin
from sidecar.control.nacks import LatestNacks
from sidecar.errors import BrokerError, StorageError
from sidecar.kafka_io import consume_batch, log_reader
from sidecar.metrics import Metrics
from sidecar.outbound.writer import Writer
from sidecar.partitions.metadata import CommitMetadata
from sidecar.partitions.state import PartitionState
from sidecar.policy.routes import IntakeRule
from sidecar.state.image import (
    ImageError,
    Manifest,
    PartitionImage,
    Record,
    manifest_key,
    rules_key,
)
from sidecar.state.journal import EARLY_LINES, NackJournal
from sidecar.state.mirror import MirroredStorage
from sidecar.tracker.base import Snapshots

logger = logging.getLogger(__name__)

NEW_TOPIC_PARTITIONS = 12
TOPIC_CONFIG = {
    "cleanup.policy": "compact",
    # Snapshot segments are at most bucket_max_indexes_per_segment * 16 bytes (80 KB by default).
    "max.message.bytes": str(8 * 1024 * 1024),
    # Tombstones stay a day, so a member that was away that long still sees a bucket go.
    "delete.retention.ms": str(24 * 3600 * 1000),
}
READ_TIMEOUT_S = 60.0
ADMIN_TIMEOUT_S = 10.0


def state_partition(partition: str, partitions: int) -> int:
    """Where an inbound partition's state lives: stable across processes and versions (crc32)."""
    return zlib.crc32(partition.encode()) % partitions


class StateTopic:
    def __init__(
        self,
        name: str,
        client_config: dict[str, Any],
        admin: TopicAdmin,
        writer: Writer,
        mirror: MirroredStorage,
        nacks: LatestNacks,
        metrics: Metrics,
    ) -> None:
        """`nacks`: the pending nacks of the control partitions, kept with a changelog for here."""
        self.name = name
        self._nacks = nacks
        self._admin = admin
        self._client_config = client_config
        self._writer = writer
        self._mirror = mirror
        mirror.reset()
        self._metrics = metrics
        self._partitions = 0
        self._manifests: dict[str, Manifest] = {}
        """The last manifest written per partition, so an unchanged one is not written again."""
        self._journals: dict[str, NackJournal] = {}
        """Each control partition's nacks as this member wrote or restored them."""
        self._consumer: Consumer | None = None
        self._rules: dict[str, str] = {}
        """The rule-history record each partition's commits name now (publish_rules)."""
        self._stale_rules: dict[str, str] = {}
        """Rule-history records replaced at the last checkpoint, to tombstone at the next."""

    def ensure(self) -> None:
        """Create the topic, compacted, if it is missing; learn its partition count."""
        try:
            partitions = self._admin.existing().get(self.name)
        except KafkaException as e:
            raise BrokerError(f"cannot read the metadata of the state topic {self.name}: {e.args[0]}") from e
        if partitions is not None:
            self._partitions = partitions
            return
        self._admin.create(
            {self.name: NEW_TOPIC_PARTITIONS},
            TOPIC_CONFIG,
            "create it yourself, compacted (cleanup.policy=compact), or grant CREATE on the cluster; "
            "--state-topic none turns it off",
        )
        self._partitions = NEW_TOPIC_PARTITIONS

    # -- writing, at the checkpoint -----------------------------------------------------------

    def publish(self, state: PartitionState) -> None:
        """Write what changed in the partition's index since the last checkpoint, and its manifest."""
        tracker = state.tracker
        if state.replaying or state.next_offset is None:
            return  # a rebuild writes once it is done: until then the index is incomplete
        if state.control:
            self._publish_nacks(state, state.next_offset)
            return
        snapshots = tracker.snapshots()
        if snapshots is None:
            return
        name = state.name
        buckets, next_id, lowest = snapshots.sealed_layout()
        cursor = state.next_offset
        tail = min(o for o in (lowest, cursor, state.drain_from) if o is not None)
        manifest = Manifest(buckets, next_id, tail, cursor)
        try:
            records, tombstones = self._mirror.take(name, buckets)
        except StorageError as e:
            logger.warning("state topic not written partition=%s error=%s", name, e)
            return  # the local store failed to read a bucket back: try again at the next checkpoint
        last = self._manifests.get(name)
        if not records and not tombstones and last is not None and (last.buckets, last.tail) == (buckets, tail):
            return
        self._send(name, records, manifest, tombstones)

    def _publish_nacks(self, state: PartitionState, cursor: int) -> None:
        """A control partition: the nacks accepted, superseded or settled since the last write,
        and the manifest. Every accepted record below the cursor is journaled by then, so the
        manifest's tail is the cursor."""
        name = state.name
        before, after = self._journal_changes(state)
        manifest = self._journals[name].manifest(cursor)
        if not before and not after and self._manifests.get(name) == manifest:
            return  # (a moved cursor is written even so: a restore reads the log again only from it)
        self._send(name, before, manifest, after)

    def journal(self, state: PartitionState) -> None:
        """Between checkpoints: a control partition's new nacks written now, once EARLY_LINES wait.

        Without a manifest, which the next checkpoint writes: a restore before it does not read
        the new chunks, and reads their nacks from the log instead, as the manifest's tail is
        below them. The dead sets written with them are as safe: an entry superseded by one in a
        new chunk is replaced by what the log gives again, and a covered one is covered.
        """
        if (
            state.replaying
            or state.next_offset is None
            or self._nacks.unwritten((state.topic, state.partition)) < EARLY_LINES
        ):
            return
        before, after = self._journal_changes(state, manifest=False)
        self._send(state.name, before, None, after)

    def _journal_changes(self, state: PartitionState, manifest: bool = True) -> tuple[list[Record], list[Record]]:
        """(records before the manifest, records after it) for what the partition's nacks did since
        the last write. A settled nack is marked dead only once a commit covers it: exactly once,
        the one this transaction holds; at least once, the last one made (state records are not
        waited for)."""
        covered = state.tracker.delivered_through() if self._writer.transactional else state.committed_through
        entries, dead = self._nacks.take((state.topic, state.partition), covered)
        journal = self._journals.get(state.name)
        if journal is None:
            journal = self._journals[state.name] = self._fresh_journal(state.name)
        return journal.write(entries, dead, manifest)

    def _fresh_journal(self, name: str) -> NackJournal:
        """A control partition that was not restored from here, as nothing was pending at its
        commit: its chunks must not take the seq of one an earlier owner wrote (its manifest may
        name it), and what that owner journaled goes after the next manifest."""
        try:
            image: PartitionImage | None = self._read(name)
        except (BrokerError, ImageError) as e:
            logger.warning("state topic not read partition=%s error=%s", name, e)
            image = None
        return NackJournal.unusable(name, image)

    def publish_rules(self, state: PartitionState) -> bool:
        """The rule history the partition's commit point names, when the metadata cannot hold it
        (`CommitMetadata.spill`); True when a record was written that the commit will point at.

        Keyed by content, so a commit always finds the history it names. The one it replaces is
        tombstoned at the next checkpoint, once a commit no longer names it.
        """
        name, record = state.name, state.rules_record
        partition = state_partition(name, self._partitions)
        stale = self._stale_rules.pop(name, None)
        if stale is not None:
            self._writer.send(self.name, rules_key(name, stale), None, [], partition=partition)
        current = self._rules.get(name)
        ref = record[0] if record is not None else None
        if ref == current:
            return False
        if current is not None:
            self._stale_rules[name] = current
        if record is None:
            del self._rules[name]
            return False
        self._writer.send(self.name, rules_key(name, record[0]), record[1], [], partition=partition)
        self._rules[name] = record[0]
        self._metrics.state_records.inc()
        logger.info("rule history written to the state topic partition=%s rules_ref=%s bytes=%d",
                    name, record[0], len(record[1]))  # fmt: skip
        return True

    def load_rules(self, name: str, ref: str) -> tuple[tuple[int, IntakeRule], ...] | None:
        """The rule history `ref` names (a commit's `rules_ref`), or None when it cannot be read."""
        try:
            value = self._read(name).values.get(rules_key(name, ref))
            if value is None:
                raise ImageError(f"no record {rules_key(name, ref).decode()}")
            rules = CommitMetadata.decode_rules(value)
        except (ImageError, BrokerError, ValueError) as e:
            logger.warning("rule history not readable partition=%s rules_ref=%s error=%s", name, ref, e)
            return None
        self._rules[name] = ref
        return rules

    def _send(self, name: str, records: list[Record], manifest: Manifest | None, tombstones: list[Record]) -> None:
        """`records`, the manifest (None: none this time) and `tombstones`, in that order."""
        written = [*records, *([] if manifest is None else [(manifest_key(name), manifest.encode())]), *tombstones]
        partition = state_partition(name, self._partitions)
        for key, value in written:
            self._writer.send(self.name, key, value, [], partition=partition)
        if manifest is not None:
            self._manifests[name] = manifest
        self._metrics.state_records.inc(len(written))

    def forget(self, state: PartitionState) -> None:
        self._manifests.pop(state.name, None)
        self._journals.pop(state.name, None)
        self._rules.pop(state.name, None)
        self._stale_rules.pop(state.name, None)
        self._mirror.forget(state.name)

    # -- reading, at a handoff ----------------------------------------------------------------

    def restore(self, state: PartitionState, committed: int, metadata: CommitMetadata) -> int | None:
        """Load the partition's index from the state topic; the offset to read the log again from, or None."""
        tracker = state.tracker
        snapshots = tracker.snapshots()
        if not state.control and snapshots is None:
            return None
        name = state.name
        started = time.monotonic()
        image: PartitionImage | None = None
        try:
            image = self._read(name)
            manifest = image.manifest()
            if manifest is None:
                raise ImageError("it holds no manifest for this partition")
            if state.control:
                self._restore_nacks(state, image, manifest, metadata.through)
            elif snapshots is not None:
                snapshots.restore(image.buckets(manifest), manifest.next_bucket_id, metadata.through)
                lowest = tracker.earliest_pending_offset()
                if metadata.earliest is not None and lowest is not None and lowest < metadata.earliest:
                    # Written before another member moved the commit past it (a drain of a removed
                    # topic dead-letters below the watermark): its entries there are not pending.
                    raise ImageError(
                        f"its index holds offset {lowest}, below the commit's earliest pending {metadata.earliest}"
                    )
        except (ImageError, BrokerError, StorageError) as e:
            logger.warning(
                "state topic not usable, reading the log again from the earliest pending record "
                "partition=%s topic=%s reason=%s",
                name,
                self.name,
                e,
            )
            self._metrics.state_restores.labels("replay").inc()
            if state.control:
                self._journals[name] = NackJournal.unusable(name, image)
            if snapshots is not None:
                self._fresh(snapshots, image, metadata)
            return None
        if not state.control:
            self._mirror.adopt(name, list(manifest.buckets))
        self._manifests[name] = manifest
        self._metrics.state_restores.labels("state-topic").inc()
        logger.info(
            "index restored from the state topic partition=%s buckets=%d entries=%d tail=%d committed=%d ms=%.0f",
            name,
            len(manifest.buckets),
            len(tracker),
            manifest.tail,
            committed,
            (time.monotonic() - started) * 1000,
        )
        return manifest.tail

    def _restore_nacks(self, state: PartitionState, image: PartitionImage, manifest: Manifest, through: int) -> None:
        """A control partition's pending nacks, into its tracker and the latest-nack table. Those
        in the old one-record-each form are accepted as new ones: the next checkpoint journals them."""
        restored = NackJournal.restore(image, manifest, through)
        for offset, nack in restored.pending:
            state.tracker.add(offset, nack.deliver_at, deliver_now=False)
            self._nacks.restore(nack, offset)
        for offset, nack in restored.legacy:
            state.tracker.add(offset, nack.deliver_at, deliver_now=False)
            self._nacks.accept(nack, offset)
        self._journals[state.name] = restored.journal

    def _fresh(self, tracker: Snapshots, image: PartitionImage | None, metadata: CommitMetadata) -> None:
        """An empty index whose new buckets take ids no record in the state topic uses."""
        try:
            tracker.restore([], image.first_free_bucket_id() if image is not None else 1, metadata.through)
            if image is not None:
                self._mirror.drop_later(image.partition, image.bucket_keys())
        except StorageError:
            tracker.clear()  # degraded: the ids may repeat, but a later manifest names only its own buckets

    def _read(self, name: str) -> PartitionImage:
        """Every record of `name` in its state partition, read to the end (the last stable offset)."""
        consumer = self._reader()
        try:
            topic = consumer.list_topics(self.name, timeout=ADMIN_TIMEOUT_S).topics.get(self.name)
        except KafkaException as e:
            raise BrokerError(f"reading the metadata of {self.name} failed: {e.args[0]}") from e
        if topic is None or topic.error is not None or not topic.partitions:
            self.ensure()  # deleted: what this member writes from now on needs it again
            raise ImageError(f"the state topic {self.name} does not exist (it was deleted?); it was created again")
        self._partitions = len(topic.partitions)
        partition = state_partition(name, self._partitions)
        image = PartitionImage(name)
        prefix = f"{name}/".encode()
        consumer.assign([TopicPartition(self.name, partition, 0)])
        deadline = time.monotonic() + READ_TIMEOUT_S
        try:
            while True:
                if time.monotonic() > deadline:
                    raise BrokerError(f"reading {self.name}/{partition} took over {READ_TIMEOUT_S:.0f} s")
                for record in consume_batch(consumer, 10_000, 0.5):
                    error = record.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            return image
                        raise BrokerError(f"reading {self.name}/{partition} failed: {error}")
                    key = record.key()
                    if key is not None and key.startswith(prefix):
                        image.take(key, record.value())
        except KafkaException as e:
            raise BrokerError(f"reading {self.name}/{partition} failed: {e.args[0]}") from e
        finally:
            consumer.unassign()

    def _reader(self) -> Consumer:
        if self._consumer is None:
            # Read whole each time, committed records only.
            self._consumer = log_reader(
                self._client_config, "delay-sidecar.state-reader", **{"isolation.level": "read_committed"}
            )
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
