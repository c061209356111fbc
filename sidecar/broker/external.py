"""A cluster someone else runs: the sidecar connects and starts nothing."""

import threading
from typing import Any

from sidecar.broker.base import BrokerLauncher, wait_for_metadata


class ExternalBroker(BrokerLauncher):
    def __init__(
        self,
        bootstrap_servers: str,
        client_config: dict[str, Any] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self._client_config = client_config or {}
        self._stop = stop

    def start(self) -> str:
        """Wait for the cluster to answer; returns early (unready) when `stop` is set meanwhile."""
        wait_for_metadata(self.bootstrap_servers, timeout_s=30, client_config=self._client_config, stop=self._stop)
        return self.bootstrap_servers

    def stop(self) -> None:
        """Nothing to stop: the cluster outlives the sidecar."""
