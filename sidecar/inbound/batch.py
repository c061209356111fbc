"""What one consumed batch accumulates on its way through the steps, settled once at its end.

Counters are labelled Prometheus children: touching one per record costs a lookup and a lock, so
the steps count here and `settle` adds each count once. The payload cache is written once per
batch for the same reason.
"""

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.clock import Clock
from sidecar.dispatch.payload_cache import CacheBatch, PayloadCache
from sidecar.metrics import Metrics
from sidecar.policy.routes import IntakeRule, Routes


@dataclass
class IntakeBatch:
    now: int
    routes: dict[str, Routes]
    payloads: CacheBatch | None
    """Payloads of records indexed for later, written once per batch."""
    metrics: Metrics
    rules: dict[str, IntakeRule] = field(default_factory=dict)
    """The rule in force per topic, made once per batch (a policy reload changes it between batches)."""
    received: Counter[str] = field(default_factory=Counter)
    delayed: Counter[str] = field(default_factory=Counter)
    sent: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    """Records written per topic and subscription."""

    def rule(self, topic: str, routes: Routes, retention_ms: int | None) -> IntakeRule:
        found = self.rules.get(topic)
        if found is None:
            found = self.rules[topic] = routes.rule(retention_ms)
        return found

    def settle(self) -> None:
        """The cached payloads written, the counts added."""
        if self.payloads is not None:
            self.payloads.write()
        metrics = self.metrics
        for topic, n in self.received.items():
            metrics.child(metrics.messages_in, topic).inc(n)
        for topic, n in self.delayed.items():
            metrics.child(metrics.messages_delayed, topic).inc(n)
        for topic, subs in self.sent.items():
            for sub, n in subs.items():
                metrics.child(metrics.delivered, topic, sub).inc(n)


def batches(
    routes: Callable[[], dict[str, Routes]], metrics: Metrics, clock: Clock, payloads: PayloadCache | None
) -> Callable[[], IntakeBatch]:
    """Opens the batch of one `take`: the time and the routes it is judged by, fixed for the whole batch."""

    def open_batch() -> IntakeBatch:
        now = clock.now_ms()
        return IntakeBatch(now, routes(), payloads.batch(now) if payloads is not None else None, metrics)

    return open_batch
