"""Metrics hooks of the bucket tracker, after Pulsar's bucket metrics, without Prometheus.

The core only counts and calls a listener; the lead wires these to prometheus_client, so the
tracker stays importable and testable without a metrics registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class TrackerListener(Protocol):
    def on_op(self, op: str, ok: bool, seconds: float) -> None:
        """One storage operation finished: op is create, load, delete, merge, checkpoint or clear."""


class NullListener:
    def on_op(self, op: str, ok: bool, seconds: float) -> None:
        pass


@dataclass(frozen=True, slots=True)
class TrackerStats:
    delayed: int
    """Messages still to deliver."""
    buckets: int
    """Sealed (immutable) buckets."""
    mutable_indexes: int
    """Entries in the last mutable bucket."""
    loaded_indexes: int
    """Entries held in memory: the mutable bucket plus the loaded segments."""
    snapshot_bytes: int
    """Bytes of live bucket snapshots on disk (segments and bitmaps)."""
    degraded: bool
    degraded_ops: tuple[str, ...]
    """Operation kinds whose last attempt failed and that the tracker will retry."""
    ops: dict[tuple[str, str], int] = field(default_factory=dict)
    """Attempts by (op, "succeed" | "failed")."""
