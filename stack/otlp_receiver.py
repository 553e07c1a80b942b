"""A minimal OTLP/HTTP trace receiver: `POST /v1/traces` (protobuf, as the OTLP exporter sends) kept in memory.

Tests and benchmarks point `--otlp-traces-endpoint` at it to see the spans a stack exports; `delay_s` makes
it a slow collector (it answers each export that late).
"""
from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)

# How often the server looks whether it was told to stop: what a stop waits at most.
SHUTDOWN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str          # "" for a root
    start_ns: int
    end_ns: int
    error: bool
    attributes: dict[str, Any]

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class OTLPReceiver:
    """Serves on 127.0.0.1 (a free port) from a daemon thread; `endpoint` is the URL to export to."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.exports = 0
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        handler = type("_Handler", (_Handler,), {"receiver": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                        name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {a.key: _value(a.value) for a in span.attributes}
                    spans.append(ReceivedSpan(span.name, service, span.trace_id.hex(), span.span_id.hex(),
                                              span.parent_span_id.hex(), span.start_time_unix_nano,
                                              span.end_time_unix_nano, span.status.code == 2, attributes))
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OTLPReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "int_value", "double_value", "bool_value") else None


class _Handler(BaseHTTPRequestHandler):
    receiver: OTLPReceiver

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.receiver.delay_s:
            time.sleep(self.receiver.delay_s)
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        self.receiver.take(body)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass
