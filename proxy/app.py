"""The Quart app: thin routes over one Forwarder, with the app's lifecycle around them."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncGenerator

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from common.openai_wire import error_body, json_bytes
from common.request_body import DrainingRequest, request_body
from common.roles import DISAGGREGATED_ROLES, ENCODE_ROLE, ROLES
from common.timeline import PROXY, parse_query
from common.trace_asgi import TraceMiddleware
from common.trace_spans import attach
from common.tracing import Tracing
from proxy.conditional_route import ConditionalRouter
from proxy.config import ProxyConfig
from proxy.discovery import EtcdDiscovery, HealthChecks
from proxy.errors import NoWorkers, ProxyError, UpstreamError, to_http
from proxy.answers import JSONAnswer
from proxy.forward import Forwarder
from proxy.kv_route import start_kv_routing
from proxy.metrics import Metrics
from proxy.prefill_queue import PrefillQueue
from proxy.phase_timeline import PhaseTimeline
from proxy.pool_metrics import PoolCollector
from proxy.status import StatusSources, status as fleet_status
from proxy.requests import CHAT, COMPLETIONS, Endpoint, parse_request
from proxy.upstream import AiohttpUpstream, Upstream
from proxy.workers import WorkerPool, WorkerRecord, kv_secret_mismatches

_JSON = "application/json"


class ProxyState:
    """What lives as long as the app: the pool, one HTTP client per worker, background tasks."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pool = WorkerPool(config.workers, on_lost=self._worker_lost,
                               legs=self._legs_in_flight if config.routing == "least_loaded" else None)
        self.metrics = Metrics()
        self.kv, self.kv_follower = start_kv_routing(
            config.kv_routing, self.pool, self._legs_in_flight, self.metrics.registry,
        ) if config.kv_routing else (None, None)
        self.conditional = ConditionalRouter(config.conditional, self.metrics,
                                             self.kv.indexes if self.kv else None) if config.conditional else None
        self.timeline = PhaseTimeline(self.metrics.registry)
        self.prefill_queue = PrefillQueue(config.prefill_queue, self.metrics) if config.prefill_queue else None
        self.tracing = Tracing.start(config.otlp_traces_endpoint, "neuron-di-proxy")
        attach(self.tracing, self.timeline)
        self.forwarder = Forwarder(self.pool, self.client, self.metrics, config.colocated, config.strategy,
                                   self.conditional, self.timeline, self.prefill_queue, config.resume_streams,
                                   self.kv, config.resend_lost_legs)
        self.discovery = EtcdDiscovery(self.pool, *config.etcd) if config.etcd else None
        self.health = HealthChecks(self.pool, self.client, config.health_timeout, config.workers, config.kv_ports_given)
        self.metrics.registry.register(PoolCollector(self.pool, _needed_roles(self), lambda: self.health.draining))
        self.status = StatusSources(self.pool, self.client, self.forwarder.legs.count, lambda: self.health.draining,
                                    self.metrics.registry, self.timeline, _needed_roles(self))
        self._clients: dict[str, Upstream] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def _legs_in_flight(self, worker: WorkerRecord) -> int:
        return self.forwarder.legs.count(worker)

    def client(self, worker: WorkerRecord) -> Upstream:
        """The worker's client, made on first use; kept for the app's life (a worker may come back)."""
        client = self._clients.get(worker.address)
        if client is None:
            client = self._clients[worker.address] = AiohttpUpstream(worker, self.config.timeouts)
        return client

    def _worker_lost(self, worker: WorkerRecord, why: str) -> None:
        self.forwarder.legs.end(worker, why)
        if self.conditional is not None:
            self.conditional.forget(worker)
        if self.kv is not None:
            self.kv.indexes.clear(worker.key)

    async def start(self) -> None:
        # One round before serving: the first answers (and /ready) already know which workers are up, and
        # a static worker's KV port is the one it shows, not the command line's default.
        await self.health.round()
        if self.prefill_queue is not None:
            self.prefill_queue.start()
        self._tasks.append(asyncio.create_task(self.health.run(self.config.health_interval)))
        if self.discovery is not None:
            self._tasks.append(asyncio.create_task(self.discovery.run()))
        if self.kv_follower is not None:
            self._tasks.append(asyncio.create_task(self.kv_follower.run(self.pool.all, self.config.health_interval)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.prefill_queue is not None:
            await self.prefill_queue.stop()
        await asyncio.gather(*(client.close() for client in self._clients.values()))
        self._clients.clear()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)


def create_app(config: ProxyConfig) -> Quart:
    """The proxy as an ASGI app; serve it with hypercorn (see proxy_server.py)."""
    app = Quart("proxy")
    app.request_class = DrainingRequest
    state = ProxyState(config)
    app.config["PROXY_STATE"] = state
    app.before_serving(state.start)
    app.after_serving(state.stop)
    if state.tracing is not None:
        app.asgi_app = TraceMiddleware(app.asgi_app, state.tracing, PROXY)  # type: ignore[method-assign]

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _forward(state, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _forward(state, CHAT)

    @app.get("/v1/models")
    async def models() -> Response:
        return await _models(state)

    @app.get("/health")
    async def health() -> Response:
        return _json_response(_health(state), 200)

    @app.get("/ready")
    async def ready() -> Response:
        return _ready(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), 200, content_type="text/plain; version=0.0.4")

    @app.get("/status")
    async def status() -> Response:
        return _json_response(await fleet_status(state.status), 200)

    @app.get("/timeline")
    async def timeline() -> Response:
        try:
            uid, n = parse_query(request.args)
        except ValueError as exc:
            return _json_response(error_body(400, f"bad query: {exc}", "invalid_request_error", "n"), 400)
        return _json_response(state.timeline.answer(uid, n), 200)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        # Unknown paths and wrong methods answer in OpenAI's error shape too.
        status = exc.code or 500
        return _json_response(error_body(status, exc.description or exc.name, "invalid_request_error"), status)

    return app


async def _forward(state: ProxyState, endpoint: Endpoint) -> Response:
    """The one forwarder behind both generation routes."""
    started = time.perf_counter()
    try:
        client_request = parse_request(endpoint, await request_body(), not state.config.colocated)
        answer = await state.forwarder.handle(client_request)
    except ProxyError as exc:
        response = _error_response(exc)
        state.metrics.requests.labels(endpoint.path, str(response.status_code)).inc()
        return response
    state.metrics.requests.labels(endpoint.path, "200").inc()
    if isinstance(answer, JSONAnswer):
        state.metrics.e2e.observe(time.perf_counter() - started)
        return Response(answer.body, 200, content_type=_JSON)
    response = Response(await _primed(answer.events), 200, content_type="text/event-stream")
    response.timeout = None  # a stream lasts as long as the answer, not Quart's 60 s default
    return response


async def _primed(events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """`events` with its first event already taken, so that the generator has started.

    A client that leaves before Quart starts sending the body cancels the send without ever
    iterating (or closing) the body. A started async generator is still closed when it is
    dropped (the event loop's finalizer runs its `finally`: legs cancelled, the request
    abandoned); one never started would not run a line, and its legs would run on unread.
    """
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        return _replay([], events)
    return _replay([first], events)


async def _replay(head: list[bytes], events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    for event in head:
        yield event
    async with contextlib.aclosing(events):
        async for event in events:
            yield event


def _health(state: ProxyState) -> dict[str, Any]:
    """Liveness: 200 while the proxy runs, with the known and healthy workers of each role."""
    return {"status": "ok", "workers": _worker_counts(state)}


def _ready(state: ProxyState) -> Response:
    """Readiness: 200 once every role the proxy needs has a healthy worker and no healthy decode worker is
    known to be unable to authenticate to a healthy prefill worker; else 503 naming the roles that have none
    and why each of their workers is out of rotation, or the pairs whose KV secrets do not match."""
    missing = [role for role in _needed_roles(state) if not state.pool.healthy(role)]
    mismatches = [] if missing or state.config.colocated else kv_secret_mismatches(
        state.pool.healthy("prefill"), state.pool.healthy("decode"))
    if not missing and not mismatches:
        return _json_response({"status": "ready", "workers": _worker_counts(state)}, 200)
    reasons = [f"no healthy {role} worker" for role in missing] + list(state.pool.reasons(_needed_roles(state)))
    reasons += mismatches
    return _json_response(error_body(503, "not ready: " + "; ".join(reasons), "service_unavailable"), 503)


def _worker_counts(state: ProxyState) -> dict[str, dict[str, int]]:
    known = state.pool.all()
    roles = ROLES + ((ENCODE_ROLE,) if any(w.role == ENCODE_ROLE for w in known) else ())
    return {role: {"known": sum(w.role == role for w in known), "healthy": len(state.pool.healthy(role))}
            for role in roles}


def _needed_roles(state: ProxyState) -> tuple[str, ...]:
    return ("both",) if state.config.colocated else DISAGGREGATED_ROLES


def _json_response(body: dict[str, Any], status: int) -> Response:
    return Response(json_bytes(body), status, content_type=_JSON)


async def _models(state: ProxyState) -> Response:
    """The union of the models the healthy workers serve."""
    roles = _needed_roles(state)
    workers = [w for role in roles for w in state.pool.healthy(role)]
    if not workers:
        return _error_response(NoWorkers(" or ".join(roles)))
    replies = await asyncio.gather(*(state.client(w).get("/v1/models", 5.0) for w in workers),
                                   return_exceptions=True)
    models: dict[str, Any] = {}
    for reply in replies:
        if isinstance(reply, UpstreamError) or reply.status != 200:
            continue
        with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
            for model in reply.json()["data"]:
                models.setdefault(model["id"], model)
    if not models:
        return _error_response(UpstreamError("no worker answered GET /v1/models"))
    return _json_response({"object": "list", "data": list(models.values())}, 200)


def _error_response(exc: ProxyError) -> Response:
    status, body, headers = to_http(exc)
    return Response(body, status, headers=headers, content_type=_JSON)
