"""The root span of each generation request a server answers (`POST /v1/...`), as ASGI middleware.

`{source}.request` starts when the request arrives, as a child of the `traceparent` it carries (a client's,
or the proxy's leg span), and ends when the last byte of the answer went out (a stream's too). It is the
current span while the request is served, so the proxy's phase spans go under it; on a worker, the request
id (`X-Request-Id`) ties it to the request's phase spans (common/trace_spans.py).
"""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from opentelemetry import context as otel_context, trace
from opentelemetry.trace import SpanKind, StatusCode

from common.trace_spans import RESPONDED, PhaseSpans
from common.tracing import Tracing, context_from

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class TraceMiddleware:
    """Wraps an ASGI app: a root span per `POST /v1/...`; `spans()` gives the phase spans of the moment (a
    worker's engine, and so its timeline, may change), None when there are none."""

    def __init__(self, app: ASGIApp, tracing: Tracing, source: str,
                 spans: Callable[[], PhaseSpans | None] = lambda: None) -> None:
        self.app = app
        self.tracing = tracing
        self.source = source
        self._spans = spans

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        at = time.time()
        uid = headers.get("x-request-id")
        spans = self._spans() if uid else None
        source = spans.source if spans is not None else self.source
        root = self.tracing.tracer.start_span(f"{source}.request", context=context_from(headers),
                                              kind=SpanKind.SERVER, start_time=int(at * 1e9),
                                              attributes={"http.route": scope["path"]})
        if uid is not None:
            root.set_attribute("neuron_di.request_id", uid)
        if spans is not None and uid is not None:
            spans.begin(uid, root, at)

        async def traced_send(message: Any) -> None:
            if message.get("type") == "http.response.start":
                root.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 400:
                    failed(f"HTTP {message['status']}")
            await send(message)

        def failed(why: str) -> None:
            root.set_status(StatusCode.ERROR, why)
            if spans is not None and uid is not None:
                spans.fail(uid, why)

        token = otel_context.attach(trace.set_span_in_context(root))
        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:  # the client left, or the server stops
            failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            raise
        finally:
            otel_context.detach(token)
            end = time.time()
            if spans is not None and uid is not None:
                spans.phase(uid, RESPONDED, end)
            root.end(end_time=int(end * 1e9))
