"""The keyed step of intake (`by_key: replace`): which pending record each new record replaces.

Live intake and a rebuild both call it with a partition's records in offset order, every one of
them (the sidecar's own records included: they move the clock), so both decide alike
(policy/by_key.py has the rule). A replaced record stays in the index and comes out at its time
to nobody (outbound/delivery.py); a tombstone that cancels is not delivered to the delayed
subscriptions. Ordered subscriptions (exclusive, failover) take every record at once, in log
order, as on any topic: nothing is pending for them.
"""

from collections.abc import Sequence

from confluent_kafka import Message

from sidecar.metrics import Metrics
from sidecar.partitions.keyed import KeyedPartition
from sidecar.partitions.state import PartitionState
from sidecar.policy.intake import Fate
from sidecar.policy.routes import IntakeRule


def keyed_of(state: PartitionState) -> KeyedPartition:
    """The partition's keyed state, started at the first record read under a keyed rule."""
    if state.keyed is None:
        state.keyed = KeyedPartition(state.tracker.key_index(), state.clock_at_start)
    return state.keyed


def is_keyed(state: PartitionState, rule: IntakeRule) -> bool:
    """Records under `rule` go through the keyed step: the rule is keyed, or an earlier one was
    (its pending records wait on the clock, which every record moves), or the commit this reading
    started from says the partition had keyed state there (its clock)."""
    return rule.keyed or state.keyed is not None or state.clock_at_start is not None


def stamp(record: Message) -> int:
    """The record's log timestamp, as the rule reads it (0 for a record without one)."""
    timestamp: int = record.timestamp()[1]
    return max(timestamp, 0)


def key_inputs(
    rule: IntakeRule, records: Sequence[Message], fates: Sequence[Fate]
) -> tuple[list[bytes | None], list[bool]]:
    """What the keyed step takes of each record: its key (None when the rule has no keys, or the
    record was dead-lettered: it replaces nothing) and whether it is a tombstone. Intake, a rebuild
    and a removed topic's drain read records alike through this."""
    if not rule.keyed:
        return [None] * len(records), [False] * len(records)
    keys = [record.key() if fate.rejected is None else None for record, fate in zip(records, fates, strict=True)]
    if all(map(len, records)):  # no value is empty, so none is null: the common slice, in one pass at C speed
        return keys, [False] * len(records)
    # len() is the value's length: only an empty value is read to tell it from a null one
    tombstones = [
        key is not None and not len(record) and record.value() is None
        for record, key in zip(records, keys, strict=True)
    ]
    return keys, tombstones


class KeyedIntake:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def note(self, state: PartitionState, records: Sequence[Message]) -> None:
        """Records that are not messages (cancels' requests and facts, clock records)."""
        keyed = keyed_of(state)
        for record in records:
            keyed.note(record.offset(), stamp(record))

    def decide(
        self,
        state: PartitionState,
        rule: IntakeRule,
        records: Sequence[Message],
        stamps: Sequence[int],
        fates: list[Fate],
    ) -> list[bool] | None:
        """For each record, whether it is delivered at all (False: a tombstone that cancels, under
        a keyed rule); None when all are. `stamps`: the records' timestamps as the client gives
        them. Offsets it replaces are set aside in the partition's keyed state. A record judged by
        a rule without keys, or dead-lettered, is given without its key: it only moves the clock,
        and replaces nothing."""
        keyed = keyed_of(state)
        keys, tombstones = key_inputs(rule, records, fates)
        replaced = keyed.take_many(
            [record.offset() for record in records],
            stamps if min(stamps, default=0) > 0 else [t if t > 0 else 0 for t in stamps],  # as stamp() reads them
            keys,
            tombstones,
            [fate.deliver_at for fate in fates],
        )
        found = len(replaced) - replaced.count(None)
        if found and state.overrides:  # a reschedule's copy of a replaced record goes to nobody either
            for offset in replaced:
                if offset is not None:
                    keyed.replaced.update(state.overrides.take_copies(offset))
        if found:
            self._metrics.child(self._metrics.replaced, state.topic).inc(found)
        if not any(tombstones):
            return None
        return [not (tombstone and key) for tombstone, key in zip(tombstones, keys, strict=True)]
