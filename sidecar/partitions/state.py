"""One inbound partition as this member holds it: where reading starts, its index, its rebuild.

The rules that decide where reading starts are in metadata.py's docstring.
"""

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.control.overrides import Overrides
from sidecar.partitions.keyed import KeyedPartition
from sidecar.partitions.metadata import MAX_METADATA_BYTES, CommitMetadata, RuleHistory
from sidecar.policy.by_key import BEFORE_ANY
from sidecar.policy.routes import IntakeRule
from sidecar.tracker.base import NOTHING_DELIVERED, DelayedDeliveryTracker

logger = logging.getLogger(__name__)

REBUILD_REPORT_S = 2.0


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
    committed_fingerprint: str | None = None
    """The last commit's CommitMetadata.fingerprint: the local index's lineage names it."""
    sent_fingerprint: str | None = None
    """At least once, that of a commit sent and not answered: the group's commit may be it."""
    lineage: tuple[str, ...] = ()
    """What the tracker's next checkpoint records as the commits it agrees with (PartitionMeta): the
    fingerprint of what `commit_point` returned last, then that of the last commit."""
    point_rules: str = ""
    """What the tracker's next checkpoint records as the rules it was judged by: those of the
    point `commit_point` returned last."""
    rules: RuleHistory = field(default_factory=RuleHistory)
    rebuild: Rebuild | None = None
    """Set while the index of this partition is rebuilt from the log (no usable local index)."""
    claiming: bool = False
    """Exactly-once, during the checkpoint of its assignment: commit only `claim_point`."""
    replay_until: int = 0
    """Control partitions: commands below this offset were judged before a restart; not again."""
    rule: IntakeRule | None = None
    """The rule live intake noted last (the hot path compares identity, not values)."""
    exact: bool = False
    """Exactly-once mode: local state is used only when it matches the commit exactly."""
    rules_record: tuple[str, bytes] | None = None
    """(ref, value) of the rule history the last commit point names, when the metadata cannot hold it:
    the checkpoint writes it to the state topic before the commit."""
    drain_from: int | None = None
    """A partition of a topic that left the policies, whose pending records are being dead-lettered
    in offset order (dispatch/drain.py): none is pending below this offset any more. Its index is
    gone; the commit alone says what is left (its earliest is this)."""
    overrides: Overrides = field(default_factory=Overrides)
    """Deliveries that cancels and reschedules took back (control/overrides.py)."""
    unread_facts: set[int] = field(default_factory=set)
    """Request offsets whose facts this member wrote and has not read back yet."""
    held_since: float = 0.0
    """When the hold began (time.monotonic)."""
    hold_until: int | None = None
    """Deliver nothing from this partition before reading up to here: facts written by an earlier
    owner may lie past the commit, and a cancel in them must be in force before anything goes out."""
    held_requests: list[tuple[int, bytes | None]] = field(default_factory=list)
    """(offset, request) read below `hold_until`: the earlier owner may have decided them, and its
    fact lies further on. They are decided once the hold's end is read, unless a fact names them."""
    decided_earlier: set[int] = field(default_factory=set)
    """Request offsets named by facts of an earlier owner read while held."""
    keyed: KeyedPartition | None = None
    """Set once a record of a keyed topic (`by_key: replace`) is read: from then on every record of
    the partition moves its clock (partitions/keyed.py)."""
    clock_at_start: int | None = None
    """The log's clock where reading started, from the commit (CommitMetadata.clock): the keyed
    state starts from it, at the first record read (inbound/keys.py: is_keyed). While the partition
    drains (`drain_from`), the clock just before the drain's progress, where a drain taken up again
    starts (dispatch/drain.py)."""

    @property
    def name(self) -> str:
        return f"{self.topic}/{self.partition}"

    def indexed(self, offset: int) -> bool:
        """Still to be delivered: in the index, and not replaced by a newer record of its key (a
        replaced one stays in the index until its time, when it goes to nobody)."""
        keyed = self.keyed
        return self.tracker.contains(offset) and (keyed is None or offset not in keyed.replaced)

    def start(self, committed: int | None, metadata: CommitMetadata, restore: "Restore | None" = None) -> int | None:
        """Where reading starts, after checking the local index against the commit.

        None means "where the group's auto.offset.reset says" (nothing committed yet). Without a
        usable local index, `restore` may load one from the state topic; the log is then read
        again only from the offset it returns (the unsealed tail), not from the earliest pending.
        A control partition's nacks are held in memory, so it always goes that way.
        """
        tracker = self.tracker
        self.rules = RuleHistory(metadata.rules)
        fingerprint = metadata.fingerprint_at(committed)
        if committed is not None:
            self.committed = (committed, metadata.encode())
        self.committed_fingerprint = fingerprint
        cursor = tracker.index_cursor()
        self.overrides, self.unread_facts = Overrides(), set()
        self.held_requests, self.decided_earlier = [], set()
        self.keyed, self.clock_at_start = None, metadata.clock
        read_again = metadata.commands or metadata.keyed or metadata.clock is not None
        if read_again and cursor is not None:
            # Cancels in force, and keys, are not in the local index: read again from the log.
            logger.info(
                "local index set aside, %s partition=%s",
                "cancels or reschedules are in force" if metadata.commands else "the topic is keyed",
                self.name,
            )
            tracker.clear()
            cursor = None
        if cursor is not None:
            lineage = tracker.lineage()
            if self._usable(cursor, committed, fingerprint, lineage):
                local = tracker.checkpointed_rules()
                if committed is not None and cursor > committed and local:
                    # At least once, one checkpoint ahead of the commit: the records between were
                    # judged by rules the commit does not name (a policy change among them).
                    try:
                        self.rules = RuleHistory(CommitMetadata.decode_rules(local.encode()))
                    except ValueError:
                        logger.warning("local index rules unreadable, using the commit's partition=%s", self.name)
                self.next_offset = cursor
                return cursor
            logger.warning(
                "local index is stale, discarding it partition=%s index_cursor=%d committed=%s "
                "commit=%s index_agrees_with=%s (%s)",
                self.name,
                cursor,
                committed,
                fingerprint,
                ",".join(lineage) or "-",
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
            self.replay_until = committed
            return earliest if tail is None else max(earliest, min(tail, committed))
        # Cancels' facts are records: with commands pending, read everything again (what the
        # buckets hold is not indexed twice) and apply the facts in log order. Keys likewise.
        start = earliest if tail is None or read_again else max(earliest, min(tail, committed))
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

    def _usable(self, cursor: int, committed: int | None, fingerprint: str | None, lineage: tuple[str, ...]) -> bool:
        """The local index agrees with the group's commit (partitions/metadata.py): it was checkpointed
        for this very commit or, at least once, for the one after it, which this commit came before."""
        if committed is None or fingerprint is None:
            return not self.exact  # the group's commits are gone (expired): only local state knows
        if self.exact:
            return cursor == committed and lineage[:1] == (fingerprint,)
        return cursor >= committed and fingerprint in lineage[:2]

    @property
    def holding(self) -> bool:
        """Not delivering: facts of an earlier owner may still be ahead (see `hold_until`; holds.py
        ends the hold once the consumer's position reaches it)."""
        return self.hold_until is not None

    @property
    def replaying(self) -> bool:
        """Reading the log again after a restart: a rebuild, or accepted nacks below the commit."""
        return self.rebuild is not None or (
            self.control and self.next_offset is not None and self.next_offset < self.replay_until
        )

    def commit_point(
        self, earliest_pending: int | None, exact: bool = False, producer: str | None = None
    ) -> tuple[int, str] | None:
        """(offset, metadata) to commit now, or None when there is nothing new to commit. Sets
        `lineage` for the tracker's checkpoint, which the caller makes next (checkpoint.py, which also
        drops the point when that checkpoint did not make the index durable up to it).

        `exact`: the commit is a transaction's (that of `producer`), which the local index need not
        have reached (see checkpoint.py); a partition still replaying delivered nothing and is not committed.
        """
        if self.next_offset is None or self.rebuild is not None or (exact and self.replaying):
            return None  # nothing read yet, or a rebuild that a crash would simply start again
        tracker = self.tracker
        # On a keyed partition a rescheduled message's key is decided from its own offset on, which
        # may be below its copy's: a rebuild starts there.
        origins = [c.origin for c in self.overrides.copies.values()] if self.keyed is not None else []
        earliest = min(
            (o for o in (earliest_pending, self.drain_from, *origins) if o is not None),
            default=self.next_offset,
        )
        clock = self.clock_at_start  # no record read since the start: the clock has not moved
        keyed = self.keyed
        if keyed is not None:
            log_clock = keyed.step.clock
            if earliest >= self.next_offset:  # nothing pending: every record below was read
                clock = log_clock.now
            elif self.drain_from is None and (sampled := log_clock.sample(earliest)) is not None:
                # A rebuild starts at the sample, up to SAMPLE_EVERY records early (a drain must
                # not: it would dead-letter again what it did below its progress).
                earliest, clock = sampled[0], BEFORE_ANY if sampled[1] is None else sampled[1]
            else:  # the keyed state began past `earliest`: the next owner starts it where it began
                clock = None
            keyed.forget_below(earliest)
        self.rules.prune(earliest)
        metadata = CommitMetadata(
            earliest,
            tracker.delivered_through(),
            self.rules.items(),
            producer,
            commands=not self.control
            and (bool(self.overrides) or bool(self.unread_facts) or self.hold_until is not None),
            control=self.control,
            clock=clock,
        )
        point = (self.next_offset, metadata.encode())
        self.point_rules = metadata.rules_text()
        fingerprint = metadata.fingerprint(self.next_offset)
        last = self.committed_fingerprint
        self.lineage = (fingerprint,) if last in (None, fingerprint) else (fingerprint, last)
        if point == self.committed:
            return None
        self.rules_record = metadata.spill()
        return point

    def claim_point(self, producer: str) -> tuple[int, str] | None:
        """The last commit again, naming `producer`: committed at assignment (`claiming`), before
        `producer` writes anything for the partition, which may commit nothing of its own for a
        while (a rebuild). A sidecar of this identity that takes the partition over then fences
        `producer`, as it fences whatever a commit names (identity.py); on a broker without
        KIP-447 that is what keeps a zombie's transaction from committing."""
        if self.committed is None:
            return None
        offset, text = self.committed
        try:
            data = json.loads(text)
        except ValueError:
            return None  # foreign metadata: nothing of ours to claim
        if not isinstance(data, dict) or data.get("producer") == producer:
            return None
        data["producer"] = producer
        claimed = json.dumps(data, separators=(",", ":"))
        return (offset, claimed) if len(claimed) <= MAX_METADATA_BYTES else None
