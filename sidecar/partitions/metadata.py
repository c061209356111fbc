"""What a partition's commit says, and which intake rule judged which offset.

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
- `producer`: exactly-once mode, the transactional.id whose transaction committed it. A sidecar of
  the same identity that takes the partition over fences it (sidecar/identity.py).
- `clock`: a keyed partition's log clock at `earliest` (policy/by_key.py), where its rebuild starts.

Local state (the bucket tracker's RocksDB) is used only when it agrees with the commit in
everything that decides a fate: each checkpoint records the fingerprint (`fingerprint`: the offset
and every field above but the producer) of the commit it was made for, and of the commit before it.
The group's commit must be the first, or, at least once, the second with the local cursor at or
past it: local state one checkpoint ahead, whose deliveries were all acknowledged. Any other commit
was made by another member since (a delivery, a drain of a removed topic, a cancel, a new rule),
and the state is discarded, never merged. In exactly-once mode local state ahead of the commit is
discarded too: its pops may be deliveries of a transaction that was aborted. Local state one
checkpoint ahead also records the rules of the point it was made for (PartitionMeta.rules): the
records between the commit and it were judged by them, and the next commit must name them.

In exactly-once mode a partition whose index is being rebuilt (or, on the control topic, whose
accepted nacks are being read again) delivers nothing until it is done: the log is read in offset
order, not in delivery order, so the watermark could not describe deliveries made on the way, and
a commit during the rebuild would cover records not read yet.
"""

import bisect
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sidecar.policy.routes import IntakeRule
from sidecar.tracker.base import KEY_SHIFT, NOTHING_DELIVERED, pack

METADATA_VERSION = 2
# Kafka refuses commit metadata over offset.metadata.max.bytes (4096 by default).
MAX_METADATA_BYTES = 3_500
_MASK = (1 << KEY_SHIFT) - 1


@dataclass(frozen=True)
class CommitMetadata:
    earliest: int | None = None
    through: int = NOTHING_DELIVERED
    rules: tuple[tuple[int, IntakeRule], ...] = ()
    producer: str | None = None
    rules_ref: str | None = None
    """Decoded only: the state-topic record holding the whole rule history (`spill`)."""
    commands: bool = False
    """Cancels or reschedules are in force, or their facts may lie past the committed offset (or,
    decoded, an older sidecar's commit names pending monotone runs, which no index holds): the
    next owner rebuilds the index from the log, facts included, and delivers nothing until it has
    read to the end of the partition (control/overrides.py)."""
    control: bool = False
    """A control partition's commit: a control topic the policies no longer name is still read while
    such a commit holds a pending nack (control/topics.py)."""
    clock: int | None = None
    """A keyed partition's: the log's clock just before `earliest` (policy/by_key.py), the greatest
    timestamp of the records below it. A rebuild starts there with it, and decides as the live
    reading did."""

    @property
    def keyed(self) -> bool:
        """A rule of the history replaces records by key: the key index, its clock and the replaced
        records are read again from `earliest`, like cancels (partitions/keyed.py)."""
        return any(rule.keyed for _, rule in self.rules)

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

    def fingerprint_at(self, committed: int | None) -> str | None:
        """`fingerprint` of a commit at `committed`; None when nothing is committed."""
        return self.fingerprint(committed) if committed is not None else None

    def fingerprint(self, offset: int) -> str:
        """The commit (offset, this metadata) as far as it decides a fate: everything but the
        producer that wrote it, which an exactly-once claim renames without changing anything else.
        A local index records the fingerprints of the commits it agrees with (PartitionMeta.lineage)."""
        data = self._fields(self._encoded_rules())
        data.pop("producer", None)
        return _digest([offset, data])

    def rules_text(self) -> str:
        """The whole rule history, as `decode_rules` reads it back."""
        return json.dumps(self._encoded_rules(), separators=(",", ":"))

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
        if self.commands:
            data["commands"] = 1
        if self.control:
            data["control"] = 1
        if self.clock is not None:
            data["clock"] = self.clock
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
        producer, ref, clock = data.get("producer"), data.get("rules_ref"), data.get("clock")
        return cls(
            earliest if isinstance(earliest, int) else None,
            watermark,
            tuple(rules),
            producer if isinstance(producer, str) else None,
            ref if isinstance(ref, str) else None,
            # Pending monotone runs (written with --monotone-runs, since removed): their members are
            # in no local index, so the partition is read again from `earliest` as with commands.
            data.get("commands") == 1 or bool(data.get("runs")),
            data.get("control") == 1,
            clock if isinstance(clock, int) and not isinstance(clock, bool) else None,
        )


def _digest(value: object) -> str:
    return hashlib.sha1(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:16]


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
