"""What the scenarios share: the sizes of a run, one scenario's result, and the run's context.

The context carries the two relays' rates from the scenarios that measure them to every later one,
which reports its own rate as a ratio to both (issue 13: "against that relay, and against the bare
one as today").
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.probe import Watermarks, create_topic

SUBSCRIPTIONS = ("billing", "shipping")


@dataclass
class Sizes:
    ceiling: int = 1_000_000
    passthrough: int = 1_000_000
    delayed: int = 1_000_000
    burst: int = 500_000
    fixed: int = 1_000_000
    window_ms: int = 60_000
    """Delays of the delayed scenario are uniform in [0, window)."""
    fixed_delay_ms: int = 20_000
    fixed_rate: float = 40_000.0
    """Produce rate of fixed-40k in records/s (fixed runs at full speed)."""
    partitions: int = 3
    startup_s: float = 8.0
    """Allowance for the sidecar's start and group join, in the lead time of pre-produced delayed records."""
    produce_rate: float = 60_000.0
    index_rate: float = 25_000.0
    """Conservative rates used only to choose when pre-produced delayed records start to fall due."""

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            ceiling=30_000,
            passthrough=30_000,
            delayed=30_000,
            burst=20_000,
            fixed=30_000,
            window_ms=5_000,
            fixed_delay_ms=3_000,
            startup_s=3.0,
        )

    def scaled(self, records: int) -> Sizes:
        """Every scenario at `records`, the burst at half (the full run's proportions)."""
        self.ceiling = self.passthrough = self.delayed = self.fixed = records
        self.burst = max(records // 2, 1)
        return self

    def lead_ms(self, records: int) -> int:
        return int(1000 * (self.startup_s + records / self.produce_rate + records / self.index_rate))


@dataclass
class Result:
    name: str
    records: int
    subscriptions: int
    completed: bool = False
    delivered: dict[str, int] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=dict)
    """Lateness over time: per bucket of deliver-at (figures["lateness_bucket_s"]) since the first one, in s;
    p50/p99/max in ms."""

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "records": self.records,
            "subscriptions": self.subscriptions,
            "completed": self.completed,
            "delivered": self.delivered,
            "figures": self.figures,
            "notes": self.notes,
            "lateness_series": self.series,
        }


@dataclass
class Context:
    bootstrap: str
    workdir: Path
    sizes: Sizes
    profile: set[str] = field(default_factory=set)
    ceiling_rate: float | None = None
    relay_rate: float | None = None
    """Per-subscription rate of the same-I/O relay (relay-2): input records/s, each written twice."""
    floor_rate: float | None = None
    """Per-subscription rate of relay-2-headers: relay-2 with the contract's per-delivery cost."""
    watermarks: Watermarks | None = None

    def wm(self) -> Watermarks:
        if self.watermarks is None:
            self.watermarks = Watermarks(self.bootstrap)
        return self.watermarks

    def topic(self, name: str, partitions: int | None = None) -> str:
        topic = f"bench.{name}-{uuid.uuid4().hex[:6]}"
        create_topic(self.bootstrap, topic, partitions or self.sizes.partitions)
        return topic

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def ratios(self, result: Result, rate: float | None) -> None:
        """A per-subscription rate against both relays, and the same-I/O relay's time for these records.

        The time is what the fixed-delay and burst targets are set in: records / the relay's rate.
        """
        result.figures["x_ceiling"] = rounded(rate / self.ceiling_rate, 3) if rate and self.ceiling_rate else None
        result.figures["x_same_io_relay"] = rounded(rate / self.relay_rate, 3) if rate and self.relay_rate else None
        if self.relay_rate:
            result.figures["same_io_relay_s"] = round(result.records / self.relay_rate, 2)


def finish(result: Result, progress_counts: dict[str, int], records: int) -> None:
    """Complete only with every record on every outbound topic; more than that is reported, not hidden."""
    result.delivered = progress_counts
    result.completed = bool(progress_counts) and all(n >= records for n in progress_counts.values())
    extra = {t: n - records for t, n in progress_counts.items() if n > records}
    if extra:
        # In exactly-once mode each transaction also leaves a commit marker, which takes an offset.
        result.notes.append(f"high watermarks past the records produced (duplicates, or commit markers): {extra}")


def rounded(value: float | None, digits: int = 0) -> float | None:
    """round() that lets a missing figure through as None, for the JSON and the table."""
    if value is None:
        return None
    return round(value, digits) if digits else float(round(value))
