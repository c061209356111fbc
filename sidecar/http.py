"""The metrics port: /metrics (Prometheus), /healthz, /policies/{topic} and /messages/{id} (contract section 7)."""

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sidecar.control.cancels import message_key
from sidecar.errors import RejectedRecord

logger = logging.getLogger(__name__)

_MESSAGE_PATHS = "ask /messages/{topic}/{partition}/{offset}, or /messages/{topic}/{partition}?key=KEY (or key_base64)"

HealthProbe = Callable[[], tuple[bool, list[str], dict[str, Any]]]
PolicyLookup = Callable[[str], dict[str, Any] | None]
MessageLookup = Callable[[str, int, int | bytes, str | None], tuple[int, dict[str, Any]]]
"""(topic, partition, offset or key, the `scope` asked for) -> (HTTP status, JSON body)."""


class StatusServer:
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: HealthProbe,
        policy: PolicyLookup,
        message: MessageLookup | None = None,
    ) -> None:
        self._message = message
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
        elif path.startswith("/messages/") and self._message is not None:
            query = parse_qs(request.path.split("?", 1)[1], keep_blank_values=True) if "?" in request.path else {}
            scope = query.get("scope", [None])[0]
            by_key = "key" in query or "key_base64" in query
            parts = unquote(path[len("/messages/") :]).rsplit("/", 1 if by_key else 2)
            topic_ok = bool(parts[0]) and "/" not in parts[0]  # Kafka topic names hold no "/"
            if not (topic_ok and len(parts) == (2 if by_key else 3) and all(p.isdigit() for p in parts[1:])):
                self._json(request, 404, {"error": _MESSAGE_PATHS})
                return
            try:
                asked = message_key({k: v[0] for k, v in query.items()}) if by_key else int(parts[2])
            except RejectedRecord as e:
                self._json(request, 400, {"error": e.message})
                return
            assert asked is not None
            status, body = self._message(parts[0], int(parts[1]), asked, scope)
            self._json(request, status, body)
        else:
            self._json(request, 404, {"error": "try /metrics, /healthz, /policies/{topic} or /messages/{id}"})

    def _json(self, request: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
        self._reply(request, status, json.dumps(body, indent=2).encode(), "application/json")

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
        request.send_response(status)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)
