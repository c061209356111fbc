"""Per-partition state: where reading starts, what the commit says, and which rule judged which offset.

Kafka's committed offset and its metadata are the durable truth of a partition. The metadata says:

- `earliest`: the lowest offset still pending. Without a usable local index, the index is rebuilt
  by reading the log again from there up to the committed offset.
- `through`: the delivered watermark (deliver-at, offset). Positions leave the tracker in that
  order, so every delayed record at or below it is done; a rebuild skips those instead of sending
  them again.
- `rules`: the intake rules in force over [earliest, committed), by first offset. A rebuild judges
  each record with the rule of its first intake, and a due record goes to the subscriptions it was
  owed then. Kafka caps commit metadata (offset.metadata.max.bytes), so a history that does not fit
  is written whole to the state topic (state/topic.py), and `rules_ref` names that record; the
  metadata then keeps only the newest rules that fit, for when the state topic cannot be read.
- `runs`: the monotone runs still pending (tracker/runs.py), which no local index holds.
- `producer`: exactly-once mode, the transactional.id whose transaction committed it. A sidecar of
  the same identity that takes the partition over fences it (sidecar/identity.py).

Local state (the bucket tracker's RocksDB) is used only when it matches the commit: its cursor and
watermark at or past the committed ones. It keeps the runs of its checkpoint too, which may be one
ahead of the commit. State left behind by an earlier owner of the partition is discarded, never
merged. In exactly-once mode, local state ahead of the commit is discarded too: its pops may be
deliveries of a transaction that was aborted, so only the commit says what was delivered (and
which runs are pending), and local state must match it exactly.

In exactly-once mode a partition whose index is being rebuilt (or, on the control topic, whose
accepted nacks are being read again) delivers nothing until it is done: the log is read in offset
order, not in delivery order, so the watermark could not describe deliveries made on the way, and
a commit during the rebuild would cover records not read yet.
"""

import bisect
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

from sidecar.errors import BrokerError, SidecarError
from sidecar.policy.routes import IntakeRule
from sidecar.tracker.base import KEY_SHIFT, NOTHING_DELIVERED, DelayedDeliveryTracker, pack
from sidecar.tracker.runs import Runs

logger = logging.getLogger(__name__)

METADATA_VERSION = 2
# Kafka refuses commit metadata over offset.metadata.max.bytes (4096 by default).
MAX_METADATA_BYTES = 3_500
REBUILD_REPORT_S = 2.0
_MASK = (1 << KEY_SHIFT) - 1


@dataclass(frozen=True)
class CommitMetadata:
    earliest: int | None = None
    through: int = NOTHING_DELIVERED
    rules: tuple[tuple[int, IntakeRule], ...] = ()
    runs: tuple[list[int], ...] = ()
    """Encoded runs (runs.Run.encode)."""
    producer: str | None = None
    rules_ref: str | None = None
    """Decoded only: the state-topic record holding the whole rule history (`spill`)."""

    def encode(self) -> str:
        rules = self._encoded_rules()
        data = self._fields(rules)
        text = json.dumps(data, separators=(",", ":"))
        if len(text) <= MAX_METADATA_BYTES:
            return text
        data["rules_ref"] = _digest(rules)
        while len(rules) > 1 and len(text) > MAX_METADATA_BYTES:
            rules = rules[1:]  # the newest that fit: a fallback for when the state topic cannot be read
            data["rules"] = rules
            text = json.dumps(data, separators=(",", ":"))
        return text

    def spill(self) -> tuple[str, bytes] | None:
        """(ref, record value) of the whole rule history when `encode` cannot hold it, else None."""
        rules = self._encoded_rules()
        if len(json.dumps(self._fields(rules), separators=(",", ":"))) <= MAX_METADATA_BYTES:
            return None
        return _digest(rules), json.dumps(rules, separators=(",", ":")).encode()

    def _fields(self, rules: list[list[Any]]) -> dict[str, Any]:
        data: dict[str, Any] = {"v": METADATA_VERSION, "earliest": self.earliest}
        if self.producer is not None:
            data["producer"] = self.producer
        if self.through != NOTHING_DELIVERED:
            data["through"] = [self.through >> KEY_SHIFT, self.through & _MASK]
        if self.runs:
            data["runs"] = list(self.runs)
        data["rules"] = rules
        return data

    def _encoded_rules(self) -> list[list[Any]]:
        return [rule.encode(offset) for offset, rule in self.rules]

    @staticmethod
    def decode_rules(value: bytes) -> tuple[tuple[int, IntakeRule], ...]:
        """A spilled rule history (`spill`); ValueError when it is not one."""
        items = json.loads(value)
        if not isinstance(items, list):
            raise ValueError("not a list of rules")
        rules = [IntakeRule.decode(item) for item in items]
        if any(r is None for r in rules):
            raise ValueError("an entry is not a rule")
        return tuple(r for r in rules if r is not None)

    @classmethod
    def decode(cls, text: str | None) -> "CommitMetadata":
        """Our metadata, v1 (earliest only) or v2; empty when foreign or absent."""
        try:
            data = json.loads(text or "")
        except ValueError:
            return cls()
        if not isinstance(data, dict) or data.get("v") not in (1, METADATA_VERSION):
            return cls()
        earliest = data.get("earliest")
        through = data.get("through")
        rules = [r for item in data.get("rules") or [] if (r := IntakeRule.decode(item)) is not None]
        watermark = NOTHING_DELIVERED
        if isinstance(through, list) and len(through) == 2 and all(isinstance(v, int) for v in through):
            watermark = pack(through[0], through[1])
        runs = tuple(run.encode() for run in Runs[Message].decode(data.get("runs")).runs)
        producer, ref = data.get("producer"), data.get("rules_ref")
        return cls(
            earliest if isinstance(earliest, int) else None,
            watermark,
            tuple(rules),
            runs,
            producer if isinstance(producer, str) else None,
            ref if isinstance(ref, str) else None,
        )


def _digest(rules: list[list[Any]]) -> str:
    return hashlib.sha1(json.dumps(rules, separators=(",", ":")).encode()).hexdigest()[:16]


class RuleHistory:
    """Intake rules by first offset, for one inbound partition."""

    def __init__(self, rules: tuple[tuple[int, IntakeRule], ...] = ()) -> None:
        self._offsets = [offset for offset, _ in rules]
        self._rules = [rule for _, rule in rules]

    def note(self, offset: int, rule: IntakeRule) -> None:
        """`rule` judges records from `offset` on (a no-op when it decides as the last one did)."""
        if self._rules and (self._rules[-1] is rule or self._rules[-1].key == rule.key):
            self._rules[-1] = rule  # the same values, with today's sources for error messages
            return
        self._offsets.append(offset)
        self._rules.append(rule)

    def at(self, offset: int) -> IntakeRule | None:
        if not self._rules:
            return None
        index = bisect.bisect_right(self._offsets, offset) - 1
        return self._rules[max(index, 0)]

    @property
    def single(self) -> IntakeRule | None:
        """The rule, when one rule covers every offset known (the common case: no lookup)."""
        return self._rules[0] if len(self._rules) == 1 else None

    def prune(self, earliest: int) -> None:
        """Drop rules that only judged offsets below `earliest`: nothing there is pending."""
        keep = max(bisect.bisect_right(self._offsets, earliest) - 1, 0)
        del self._offsets[:keep], self._rules[:keep]

    def items(self) -> tuple[tuple[int, IntakeRule], ...]:
        return tuple(zip(self._offsets, self._rules, strict=True))


@dataclass
class Rebuild:
    """Reading [start, until) of a partition again, to rebuild an index that was not kept."""

    start: int
    until: int
    through: int
    """The committed watermark: records at or below it were delivered before."""
    started: float = field(default_factory=time.monotonic)
    reported: float = field(default_factory=time.monotonic)
    indexed: int = 0
    redelivered: int = 0

    def progress(self, name: str, offset: int) -> bool:
        """Log progress every few seconds and at the end; True once the rebuild is done."""
        clock = time.monotonic()
        done = offset + 1 >= self.until
        if done or clock - self.reported >= REBUILD_REPORT_S:
            self.reported = clock
            rate = (offset + 1 - self.start) / max(clock - self.started, 1e-3)
            logger.info(
                "index rebuild %s partition=%s offset=%d until=%d indexed=%d redelivered=%d rate=%.0f/s eta=%.0fs",
                "done" if done else "progress",
                name,
                offset,
                self.until,
                self.indexed,
                self.redelivered,
                rate,
                max(self.until - offset - 1, 0) / max(rate, 1e-3),
            )
        return done


Restore = Callable[["PartitionState", int, CommitMetadata], int | None]
"""Loads a partition's index from elsewhere (the state topic) given the commit: returns the offset
from which the log must be read again, or None when nothing usable was found."""


@dataclass
class PartitionState:
    topic: str
    partition: int
    tracker: DelayedDeliveryTracker
    control: bool = False
    """A control-topic partition: its tracker indexes accepted nacks by their control offset."""
    next_offset: int | None = None
    committed: tuple[int, str] | None = None
    """(offset, metadata) of the last commit, so an unchanged partition is not committed again."""
    rules: RuleHistory = field(default_factory=RuleHistory)
    rebuild: Rebuild | None = None
    """Set while the index of this partition is rebuilt from the log (no usable local index)."""
    replay_until: int = 0
    """Control partitions: commands below this offset were judged before a restart; not again."""
    replay_through: int = NOTHING_DELIVERED
    """Control partitions: the committed watermark; accepted nacks at or below it are done."""
    rule: IntakeRule | None = None
    """The rule live intake noted last (the hot path compares identity, not values)."""
    runs: Runs[Message] = field(default_factory=Runs)
    exact: bool = False
    """Exactly-once mode: local state is used only when it matches the commit exactly."""
    rules_record: tuple[str, bytes] | None = None
    """(ref, value) of the rule history the last commit point names, when the metadata cannot hold it:
    the checkpoint writes it to the state topic before the commit."""
    drain_from: int | None = None
    """A partition of a topic that left the policies, whose pending records are being dead-lettered
    in offset order (dispatch/drain.py): none is pending below this offset any more. Its index is
    gone; the commit alone says what is left (its earliest is this)."""

    def runs_text(self) -> str:
        return json.dumps(self.runs.encode(), separators=(",", ":"))

    @property
    def name(self) -> str:
        return f"{self.topic}/{self.partition}"

    def start(self, committed: int | None, metadata: CommitMetadata, restore: "Restore | None" = None) -> int | None:
        """Where reading starts, after checking the local index against the commit.

        None means "where the group's auto.offset.reset says" (nothing committed yet). Without a
        usable local index, `restore` may load one from the state topic; the log is then read
        again only from the offset it returns (the unsealed tail), not from the earliest pending.
        A control partition's nacks are held in memory, so it always goes that way.
        """
        tracker = self.tracker
        self.rules = RuleHistory(metadata.rules)
        if committed is not None:
            self.committed = (committed, metadata.encode())
        cursor = tracker.index_cursor()
        self.runs = Runs[Message].decode(list(metadata.runs))
        if cursor is not None:
            if self._usable(cursor, committed, tracker.delivered_through(), metadata.through):
                self.next_offset = cursor
                stored = tracker.stored_runs()
                # As of the local checkpoint, which may be one ahead of the commit (never in
                # exactly-once mode, where the commit's runs are the truth).
                if stored is not None and not self.exact:
                    self.runs = Runs[Message].decode(json.loads(stored))
                return cursor
            logger.warning(
                "local index is stale, discarding it partition=%s index_cursor=%d committed=%s "
                "local_through=%d committed_through=%d (%s)",
                self.name,
                cursor,
                committed,
                tracker.delivered_through(),
                metadata.through,
                "exactly-once: its last checkpoint's transaction was not committed, or another member owned "
                "the partition since"
                if self.exact
                else "another member owned the partition since this state dir was written",
            )
            tracker.clear()
        elif len(tracker):
            tracker.clear()
        tracker.restore_delivered_through(metadata.through)
        self.next_offset = committed
        earliest = metadata.earliest
        if committed is None or earliest is None or earliest >= committed:
            self.replay_until = committed or 0
            return committed
        tail = restore(self, committed, metadata) if restore is not None else None
        if self.control:  # accepted nacks: from the state topic's tail, else from the earliest pending
            self.runs = Runs()
            self.replay_until, self.replay_through = committed, metadata.through
            return earliest if tail is None else max(earliest, min(tail, committed))
        # Run members are in no bucket: with runs pending, read everything again (what the buckets
        # hold is not indexed twice). The rebuild indexes their members one by one.
        start = earliest if tail is None or metadata.runs else max(earliest, min(tail, committed))
        self.runs = Runs()
        if start < committed:
            self.rebuild = Rebuild(start, committed, metadata.through)
            logger.info(
                "index rebuild started partition=%s from=%d until=%d pending_from=%d source=%s",
                self.name,
                start,
                committed,
                earliest,
                "log" if tail is None else "state-topic+log",
            )
        return start

    @property
    def committed_through(self) -> int:
        """The delivered watermark of the last commit: what a restart would take as done."""
        return CommitMetadata.decode(self.committed[1]).through if self.committed else NOTHING_DELIVERED

    def _usable(self, cursor: int, committed: int | None, local_through: int, through: int) -> bool:
        if self.exact:  # (the bucket tracker's "nothing delivered" is 0, the metadata's -1)
            return committed is not None and cursor == committed and max(local_through, 0) == max(through, 0)
        return committed is None or (cursor >= committed and local_through >= through)

    @property
    def replaying(self) -> bool:
        """Reading the log again after a restart: a rebuild, or accepted nacks below the commit."""
        return self.rebuild is not None or (
            self.control and self.next_offset is not None and self.next_offset < self.replay_until
        )

    def commit_point(
        self, earliest_pending: int | None, exact: bool = False, producer: str | None = None
    ) -> tuple[int, str] | None:
        """(offset, metadata) to commit now, or None when there is nothing new to commit.

        `exact`: the commit is a transaction's (that of `producer`), which the local index need not
        have reached (see checkpoint.py); a partition still replaying delivered nothing and is not committed.
        """
        if self.next_offset is None or self.rebuild is not None or (exact and self.replaying):
            return None  # nothing read yet, or a rebuild that a crash would simply start again
        tracker = self.tracker
        draining = self.drain_from is not None
        if not exact and not draining and tracker.durable and tracker.index_cursor() != self.next_offset:
            return None  # the index is not durable up to here: the commit must not pass it
        runs = self.runs
        earliest = min(
            (o for o in (earliest_pending, runs.earliest_offset(), self.drain_from) if o is not None),
            default=self.next_offset,
        )
        self.rules.prune(earliest)
        metadata = CommitMetadata(
            earliest, tracker.delivered_through(), self.rules.items(), tuple(runs.encode()), producer
        )
        point = (self.next_offset, metadata.encode())
        if point == self.committed:
            return None
        self.rules_record = metadata.spill()
        return point


class Assignment:
    """The partitions this member owns, kept in step with the group's rebalances.

    `on_assign` opens each partition's tracker and seeks to where `PartitionState.start` says.
    `on_revoke` checkpoints first (the partition goes to another member with nothing left
    uncommitted); `on_lost` does not (another member may own it already), and in exactly-once
    mode aborts the open transaction and has the engine start again.
    """

    def __init__(
        self,
        tracker_factory: Callable[[str, int], DelayedDeliveryTracker],
        control_topic: str,
        checkpoint: Callable[[], None],
        forget: Callable[[PartitionState], None],
        abort: Callable[[], None] | None = None,
        incremental: bool = False,
        on_handoff: Callable[[str, int, int], None] | None = None,
        restore: Restore | None = None,
        fence: Callable[[str], None] | None = None,
        load_rules: Callable[[str, str], tuple[tuple[int, IntakeRule], ...] | None] | None = None,
    ) -> None:
        """`fence`: exactly-once mode, called with the transactional.id of each assigned partition's
        last commit, before the partition is read (a zombie of this identity must not commit)."""
        self.states: dict[tuple[str, int], PartitionState] = {}
        self._fence = fence
        self._load_rules = load_rules
        """The whole rule history a commit's `rules_ref` names, from the state topic (None: not found)."""
        self._restore = restore
        self._abort = abort
        """Exactly-once mode: drops the open transaction when partitions are lost."""
        self.error: Exception | None = None
        """Why the engine must start again, found in a callback: raised from there, an exception
        would reach librdkafka's C code and come out of poll as a bare SystemError."""
        self._factory = tracker_factory
        self._control_topic = control_topic
        self._checkpoint = checkpoint
        self._forget = forget
        self._incremental = incremental
        self._on_handoff = on_handoff
        """Told (event, partitions moved, partitions owned) after each change, for the metrics."""
        """cooperative-sticky: callbacks name only the partitions that change; otherwise all of them."""
        self.failed = False
        """Set after a failure: nothing more may be committed, so revokes do not checkpoint."""
        self.assigned = threading.Event()

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        starts = []
        for tp in consumer.committed(partitions, timeout=30):
            key = (tp.topic, tp.partition)
            state = self.states.get(key)
            if state is None:
                tracker = self._factory(tp.topic, tp.partition)
                control = tp.topic == self._control_topic
                state = PartitionState(tp.topic, tp.partition, tracker, control=control, exact=self._abort is not None)
                self.states[key] = state
            committed = tp.offset if tp.offset >= 0 else None
            metadata = CommitMetadata.decode(tp.metadata)
            if metadata.rules_ref is not None:
                metadata = self._full_rules(state.name, metadata)
            if self._fence is not None and metadata.producer is not None and self.error is None:
                try:
                    self._fence(metadata.producer)
                except SidecarError as e:  # raised by the engine after poll, not into librdkafka
                    self.failed, self.error = True, e
            start = state.start(committed, metadata, self._restore)
            starts.append(TopicPartition(tp.topic, tp.partition, start if start is not None else tp.offset))
        if self._incremental:
            consumer.incremental_assign(starts)
        else:
            consumer.assign(starts)
        self.assigned.set()
        self._handoff("assigned", len(starts))
        logger.info("partitions assigned partitions=%s", _names(starts))

    def _full_rules(self, name: str, metadata: CommitMetadata) -> CommitMetadata:
        ref = metadata.rules_ref
        rules = self._load_rules(name, ref) if self._load_rules is not None and ref is not None else None
        if rules is None:
            logger.error(
                "the rule history named by the commit is not in the state topic; records older than the "
                "newest rules kept in the metadata are judged with the oldest of them partition=%s rules_ref=%s "
                "rules_kept=%d",
                name,
                ref,
                len(metadata.rules),
            )
            return metadata
        return replace(metadata, rules=rules)

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if not self.failed:
            try:
                self._checkpoint()
            except Exception as e:  # a fenced producer, a broker gone: the engine raises it after poll
                self.failed, self.error = True, e
        self._drop(partitions)
        self._handoff("revoked", len(partitions))
        logger.info("partitions revoked partitions=%s", _names(partitions))

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._abort is not None:
            # Another member may own them and deliver what this transaction holds: abort it. Its
            # pops of the partitions kept are undone only by starting again from the commit.
            self._abort()
            self.failed = True
            self.error = BrokerError(
                "partitions were lost to the group (this member was away longer than the session timeout); "
                "their transaction was aborted and the engine starts again from the commit"
            )
        self._drop(partitions)
        self._handoff("lost", len(partitions))
        logger.warning("partitions lost partitions=%s", _names(partitions))

    def _handoff(self, event: str, moved: int) -> None:
        if self._on_handoff is not None:
            self._on_handoff(event, moved, len(self.states))

    def _drop(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            state = self.states.pop((tp.topic, tp.partition), None)
            if state is not None:
                self._forget(state)
                state.tracker.close()


def _names(partitions: list[TopicPartition]) -> str:
    return ",".join(f"{tp.topic}/{tp.partition}" for tp in partitions) or "-"
