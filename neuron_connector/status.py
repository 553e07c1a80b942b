"""A small HTTP status server for a worker whose own HTTP API is not ours (`vllm serve` with
NeuronConnector): `GET /timeline` (common/timeline.py) and `GET /metrics` (the timeline's span
histograms and the connector's counters, Prometheus text). Read-only, bound to the KV host."""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.timeline import Timeline, parse_query
from neuron_connector.errors import PeerUnavailable

log = logging.getLogger(__name__)
SHUTDOWN_POLL_S = 0.05   # how often the serving thread looks for close(): a close waits up to this long


class StatusServer:
    """Serves `timeline` on host:port (port 0: a free one; `port` tells which) from a daemon thread."""

    def __init__(self, timeline: Timeline, host: str, port: int) -> None:
        self.timeline = timeline
        handler = type("_Handler", (_Handler,), {"timeline": timeline})
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise PeerUnavailable(f"the status server cannot listen on {host}:{port}: {exc}") from exc
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                        name=f"kv-status-{self.port}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    timeline: Timeline

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        if url.path == "/timeline":
            try:
                uid, n = parse_query(dict(parse_qsl(url.query)))
            except ValueError as exc:
                self._send(400, "application/json", _error(400, f"bad query: {exc}"))
                return
            self._send(200, "application/json", json.dumps(self.timeline.answer(uid, n)).encode())
        elif url.path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.timeline.registry))
        else:
            self._send(404, "application/json", _error(404, f"no such path {url.path!r}: try /timeline, /metrics"))

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("status server: " + format, *args)


def _error(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
