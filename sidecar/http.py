"""The metrics port: /metrics (Prometheus), /healthz and /policies/{topic} (contract section 7)."""

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

HealthProbe = Callable[[], tuple[bool, list[str], dict[str, Any]]]
PolicyLookup = Callable[[str], dict[str, Any] | None]


class StatusServer:
    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, health: HealthProbe, policy: PolicyLookup
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("http request %s", format % args)

        self._registry = registry
        self._health = health
        self._policy = policy
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("status endpoint listening port=%d", self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(request, 200, generate_latest(self._registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            ready, reasons, details = self._health()
            body = {"status": "ready" if ready else "not ready", "reasons": reasons, "details": details}
            self._json(request, 200 if ready else 503, body)
        elif path.startswith("/policies/") and len(path) > len("/policies/"):
            topic = unquote(path[len("/policies/") :])
            found = self._policy(topic)
            if found is None:
                self._json(request, 404, {"error": f"no policy applies to topic {topic!r}"})
            else:
                self._json(request, 200, found)
        else:
            self._json(request, 404, {"error": "try /metrics, /healthz or /policies/{topic}"})

    def _json(self, request: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
        self._reply(request, status, json.dumps(body, indent=2).encode(), "application/json")

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
        request.send_response(status)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)
