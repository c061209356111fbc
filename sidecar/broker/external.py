"""A cluster someone else runs: the sidecar connects and starts nothing."""

from typing import Any

from sidecar.broker.base import BrokerLauncher, wait_for_metadata


class ExternalBroker(BrokerLauncher):
    def __init__(self, bootstrap_servers: str, client_config: dict[str, Any] | None = None) -> None:
        self.bootstrap_servers = bootstrap_servers
        self._client_config = client_config or {}

    def start(self) -> str:
        wait_for_metadata(self.bootstrap_servers, timeout_s=30, client_config=self._client_config)
        return self.bootstrap_servers

    def stop(self) -> None:
        """Nothing to stop: the cluster outlives the sidecar."""
