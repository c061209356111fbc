"""The process's restart loop (SidecarApp._serve): a failed engine is built again, never the end."""

import threading
from typing import Any, cast

import pytest

import sidecar.app
from sidecar.app import SidecarApp
from sidecar.engine import Sidecar
from sidecar.errors import BrokerError
from sidecar.settings import RunSettings


class Served:
    """Stands in for the engine: assigned once it runs, and its run returns at once, as after a stop."""

    def __init__(self) -> None:
        self.assigned = threading.Event()
        self.running = False

    def run(self) -> None:
        self.running = True
        self.assigned.set()

    def stop(self) -> None:
        self.running = False


def test_an_engine_that_cannot_be_built_while_the_brokers_are_away_is_built_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: building raised out of the loop (exactly-once fences the earlier transactional.id on
    construction) and the process exited a minute into a broker outage."""
    monkeypatch.setattr(sidecar.app, "RESTART_BACKOFF_S", 0.01)
    app = SidecarApp(RunSettings())
    attempts: list[str] = []
    health: list[tuple[bool, list[str], dict[str, Any]]] = []

    def build() -> Sidecar:
        attempts.append("build")
        if len(attempts) < 3:
            raise BrokerError("could not end transactional.id 'x' left by an earlier run; check broker health")
        health.append(app._health())  # what /healthz said while the engines could not be built
        return cast(Sidecar, Served())

    app._serve(build)
    assert attempts == ["build"] * 3
    assert app.metrics.registry.get_sample_value("delay_sidecar_engine_restarts_total") == 2
    ready, reasons, _ = health[0]
    assert not ready and "could not end transactional.id" in reasons[0]
