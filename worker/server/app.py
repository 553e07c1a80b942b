"""The worker's OpenAI-compatible HTTP server: a Quart app around one AsyncEngine.

    POST /v1/completions         one prompt (text or token ids); JSON, or SSE with `"stream": true`
    POST /v1/chat/completions    messages rendered by the model's chat template; JSON or SSE
    GET  /v1/models              the served model
    GET  /health                 200 while the engine thread runs, else 503; `draining` says whether it drains
                                 or changes role (then no new request is taken); `python -m worker` adds its
                                 WorkerRecord as `worker` (role, kv_host, kv_port, engine_id, ...); a change of
                                 role shows as `changing_role` (the role it goes to), then `last_role_change`
    POST /drain                  starts the drain (worker/server/drain.py), as SIGTERM does; 202
    POST /role                   `{"role": "prefill"|"decode"}` starts a change of role (role_flip.py); 202
    POST /abort_request          `{"rid": id}` ends request `id` (as SGLang's endpoint does): the proxy's
                                 way to end a disaggregated leg whose client left (on a prefill worker,
                                 also KV held for a pull, or a leg that has not arrived yet)
    GET  /metrics                Prometheus text (worker/server/metrics.py)
    GET  /timeline               the phases of recent disaggregated legs here (common/timeline.py)

`X-Request-Id` becomes the engine's request id and is echoed on every response (request_id.py). Every error,
whatever raised it, is turned into a status and an OpenAI-style body by protocol.error_for.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from prometheus_client import generate_latest
from quart import Quart, Response, g, jsonify, make_response, request

from worker.server.async_engine import AsyncEngine, RequestStream
from worker.server.drain import DEFAULT_TIMEOUT_S, Drain
from worker.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.request import RequestOutput
from worker.errors import DrainingError, WorkerError, invalid
from worker.multimodal.media import MediaPolicy
from worker.multimodal.prompt import MultiModalPrompt
from worker.multimodal.fetch import EmbedsFetcher
from worker.multimodal.parts import PartResolver
from worker.multimodal.images import ImageResolver
from worker.server.choice import Choice, choice_spec
from worker.server.generation import Part, collect, events
from worker.server.fleet_gauges import fleet_gauges_page
from worker.server.metrics import ServerMetrics
from worker.server.registrar import Registrar
from worker.server.role_flip import EngineMaker, RoleFlip
from worker.server.remote_prefill import RemotePrefills, first_output
from worker.server.prompts import request_prompts
from worker.server.request_id import use_request_ids
from worker.server.responses import Kind, ResponseShape
from worker.server.token_text import TokenStrings
from worker.sampling_params import SamplingParams
from common.handoff import KV_TRANSFER_PARAMS, DecodeParams, PrefillHandoff, PrefillParams, QueuedDecodeParams
from common.openai_wire import error_body
from common.timeline import Timeline, parse_query
from common.trace_asgi import TraceMiddleware
from common.trace_spans import attach, spans_of
from common.tracing import Tracing
from common.worker_record import WorkerRecord
from common.request_body import DrainingRequest, request_body
from worker.server.protocol import GenerateRequest, build_params, error_for, models_body, parse_body, parse_request
if TYPE_CHECKING:  # imports NATS's client
    from worker.server.prefill_puller import PrefillPuller
    from worker.server.queued_prefill import QueuedPrefills

logger = logging.getLogger(__name__)


def create_app(engine_config: EngineConfig, *, engine_factory: Callable[[], LLMEngine] | None = None,
               drain_timeout: float = DEFAULT_TIMEOUT_S, media_policy: MediaPolicy | None = None,
               embeds_region: Callable[[int, Any], Any] | None = None, registrar: Registrar | None = None,
               make_engine: EngineMaker | None = None, tracing: Tracing | None = None) -> Quart:
    """A Quart app serving one engine; the engine starts in `before_serving` and stops in `after_serving`.

    `engine_factory` builds the engine on its thread; the default is `LLMEngine(engine_config)`.
    `media_policy` says where chat image parts may be loaded from (default: no local files).
    `embeds_region(hidden_size, dtype)` makes the RowRegion a prefill worker pulls encoded image parts into.
    `registrar` shows (and registers) the worker's record once the engine runs; `make_engine(role, model)`
    builds an engine of another role on the loaded model, for POST /role (without it the route answers 400).
    A drain, once over, sets the worker's `drain.done`: the server should stop then. With `tracing`, each
    request is traced (common/trace_spans.py).
    """
    app = Quart(__name__)
    app.request_class = DrainingRequest
    app.json.sort_keys = False  # bodies keep vLLM's key order
    worker = _Worker(engine_factory or (lambda: LLMEngine(engine_config)), drain_timeout,
                     media_policy or MediaPolicy(), embeds_region, registrar, make_engine, tracing)
    if tracing is not None:
        app.asgi_app = TraceMiddleware(app.asgi_app, tracing, "worker",  # type: ignore[method-assign]
                                       lambda: spans_of(worker._timeline()))
    app.before_serving(worker.startup)
    app.after_serving(worker.shutdown)
    use_request_ids(app)
    app.register_error_handler(Exception, worker.error)
    app.add_url_rule("/v1/completions", "completions", worker.completions, methods=["POST"])
    app.add_url_rule("/v1/chat/completions", "chat", worker.chat, methods=["POST"])
    app.add_url_rule("/v1/models", "models", worker.models, methods=["GET"])
    app.add_url_rule("/health", "health", worker.health, methods=["GET"])
    app.add_url_rule("/drain", "drain", worker.start_drain, methods=["POST"])
    app.add_url_rule("/role", "role", worker.change_role, methods=["POST"])
    app.add_url_rule("/abort_request", "abort_request", worker.abort_request, methods=["POST"])
    app.add_url_rule("/metrics", "metrics", worker.metrics_page, methods=["GET"])
    app.add_url_rule("/timeline", "timeline", worker.timeline_page, methods=["GET"])
    app.extensions["neuron_di_worker"] = worker
    return app


class _Worker:
    """The app's state and route handlers; one per app, so several apps can share a process."""

    def __init__(self, factory: Callable[[], LLMEngine], drain_timeout: float, media_policy: MediaPolicy,
                 embeds_region: Callable[[int, Any], Any] | None, registrar: Registrar | None,
                 make_engine: EngineMaker | None, tracing: Tracing | None = None) -> None:
        self.async_engine = AsyncEngine(factory)
        self.tracing = tracing
        self.media_policy = media_policy
        self.embeds_region = embeds_region
        self.region: Any = None
        self.images: PartResolver | None = None
        self.drain = Drain(self.async_engine, drain_timeout)
        self.registrar = registrar
        self.role_flip = None if make_engine is None else RoleFlip(
            self.async_engine, self.drain, make_engine, self.engine_changed, self.publish,
            registrar.leave if registrar is not None else lambda: None)
        self.metrics: ServerMetrics | None = None
        self.model_name = ""
        self.max_model_len = 0
        self.created = int(time.time())
        self.remote_prefills = RemotePrefills()  # decode_first: the prefill legs this decode worker sends
        self.queued_prefills: QueuedPrefills | None = None  # decode_first through the global prefill queue
        self.prefill_puller: PrefillPuller | None = None    # a prefill worker's jobs from that queue
        self.strings: TokenStrings | None = None  # the texts logprobs show for tokens

    @property
    def record(self) -> WorkerRecord | None:
        return None if self.registrar is None else self.registrar.record

    async def startup(self) -> None:
        """Starts the engine; `python -m worker` calls it before serving, hypercorn's lifespan then skips it."""
        if self.metrics is not None:
            return
        await self.async_engine.start()
        engine = self.async_engine.llm_engine
        assert engine is not None  # start() returned, so the engine was built
        self.model_name, self.max_model_len = engine.model_name, engine.max_model_len
        self.metrics = ServerMetrics(self.model_name)
        self.strings = TokenStrings(engine.tokenizer)
        hidden, dtype = engine.model_config.hidden_size, engine.kv_layout.torch_dtype
        if self.embeds_region is not None:
            self.region = await asyncio.to_thread(self.embeds_region, hidden, dtype)
        self.engine_changed()
        if self.registrar is not None:
            self.drain.leave = self.registrar.leave   # a drain leaves the registry first
            await self.publish()

    def engine_changed(self) -> None:
        """Attaches the metrics and the image-part resolver to the engine (at start, and after a change of role)."""
        engine = self.async_engine.llm_engine
        assert engine is not None and self.metrics is not None
        hidden, dtype = engine.model_config.hidden_size, engine.kv_layout.torch_dtype
        self.images = PartResolver(ImageResolver(self.media_policy, hidden, dtype),
                                   None if self.region is None else EmbedsFetcher(self.region),
                                   engine.config.role == "decode")
        attach(self.tracing, self._timeline())
        if engine.kv_connector is not None:
            engine.kv_connector.on_transfer = self.metrics.transfer_done
            engine.kv_connector.on_integrity_check = self.metrics.integrity_checked
            engine.kv_connector.on_pull = self.metrics.pull_done

    async def publish(self) -> None:
        if self.registrar is not None:
            await self.registrar.publish(self.async_engine.llm_engine)

    async def shutdown(self) -> None:
        if self.registrar is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.registrar.leave)
        await self.remote_prefills.close()
        await self.async_engine.stop()
        if self.images is not None:
            await self.images.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)

    # ---- routes -------------------------------------------------------------------------------

    async def completions(self) -> Response:
        return await self._serve("completion")

    async def chat(self) -> Response:
        return await self._serve("chat")

    async def models(self) -> Response:
        engine = self.async_engine.llm_engine
        assert engine is not None
        return jsonify(models_body(self.model_name, self.max_model_len, self.created, engine.config.dtype,
                                   engine.model_config.hidden_size))

    async def start_drain(self) -> Response:
        self.drain.start()
        return _json({"status": "draining"}, 202)

    async def change_role(self) -> Response:
        role = parse_body(await request_body()).get("role")
        if self.role_flip is None:
            raise invalid("this worker cannot change role (it was not started by `python -m worker`)", "role")
        body, status = self.role_flip.request(role)
        return _json(body, status)

    async def abort_request(self) -> Response:
        rid = parse_body(await request_body()).get("rid")
        if not isinstance(rid, str) or not rid:
            raise invalid("`rid` must be the request's id, a non-empty string", "rid")
        self.async_engine.abort(rid)
        return jsonify({"status": "ok"})

    async def health(self) -> Response:
        if not self.async_engine.is_alive():
            return _json(error_body(503, "the engine is not running", "server_error"), 503)
        body: dict = {"status": "draining" if self.drain.refuses_new else "ok", "draining": self.drain.refuses_new}
        if self.record is not None:  # a static proxy learns this worker's role and signal plane from it
            body["worker"] = self.record.to_dict()
        if self.role_flip is not None:
            body.update(self.role_flip.health_fields())
        return jsonify(body)

    async def metrics_page(self) -> Response:
        assert self.metrics is not None
        page = self.metrics.render(self.async_engine.stats)
        if (timeline := self._timeline()) is not None:
            page += generate_latest(timeline.registry)
        engine = self.async_engine.llm_engine
        page += fleet_gauges_page(self.model_name, engine.kv_connector if engine is not None else None,
                                  self.drain.refuses_new,
                                  None if self.prefill_puller is None else self.prefill_puller.held)
        return Response(page, content_type=ServerMetrics.content_type)

    async def timeline_page(self) -> Response:
        try:
            uid, n = parse_query(request.args)
        except ValueError as exc:
            raise invalid(f"bad query: {exc}", "n") from exc
        timeline = self._timeline()
        if timeline is None:  # role both: no leg is disaggregated here
            return jsonify({"source": "both", "requests": []})
        return jsonify(timeline.answer(uid, n))

    def _timeline(self) -> Timeline | None:
        engine = self.async_engine.llm_engine
        return engine.kv_connector.timeline if engine is not None and engine.kv_connector is not None else None

    # ---- errors: every status comes from protocol.error_for ----------------------------------

    async def error(self, exc: Exception) -> Response:
        status, body, headers = error_for(exc)
        if status >= 500 and not isinstance(exc, DrainingError):  # a drain's refusals are expected
            _log_failure(f"request {g.get('request_id')}", exc)
        self._count(str(status))
        response = _json(body, status)
        response.headers.update(headers)
        return response

    @contextlib.asynccontextmanager
    async def _disconnect_counted(self) -> AsyncIterator[None]:
        """Counts clients that went away mid-request (the stream's own exit aborts the request)."""
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            self._count("disconnect")
            raise

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.request_done(outcome)

    # ---- generation ---------------------------------------------------------------------------

    async def _serve(self, kind: Kind) -> Response:
        assert self.metrics is not None
        with self.drain.admitting():
            body = parse_body(await request_body())
            req = parse_request(kind, body, self.model_name)
            prompts = await self._prompts(req)
            params = [build_params(req, len(p.token_ids), self.max_model_len) for p in prompts]
            prefill_url = req.leg.remote_url if isinstance(req.leg, DecodeParams) else None
            queued = isinstance(req.leg, QueuedDecodeParams)  # decode_first through the global prefill queue
            start = functools.partial(self._start, prompts=prompts, params=params)
            if queued:  # NATS's client is imported only by a worker that puts legs on the prefill queue
                from worker.server.queued_prefill import queued_decode
            parts = await (queued_decode(self.queued_prefills, req, request.path, body, prompts, start) if queued
                           else start(req))
        prefill = None
        if prefill_url:  # image rows are the prefill worker's to fetch: it gets the client's chat body then
            prompt = prompts[0]
            prefill = (self.remote_prefills.start(prefill_url, g.request_id, request.path, body) if prompt.spans else
                       self.remote_prefills.start(prefill_url, g.request_id, "/v1/completions",
                                                  {"prompt": prompt.token_ids, **req.wire_sampling()}))
        shape = ResponseShape(kind, g.request_id, self.model_name)
        # A decode leg awaits its first output (the pulled KV) before the headers go out, so a
        # failed transfer is a plain HTTP error the proxy can act on, not a 200 stream.
        if req.is_decode_leg and not queued:
            parts[0].first = await self._first(parts[0].stream, prefill)
        if not req.stream:
            return await self._collect(shape, req, parts)
        response = await make_response(self._events(shape, req, parts),
                                       {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        response.timeout = None  # generation may outlast Quart's 60 s response timeout
        return response

    async def _start(self, req: GenerateRequest, prompts: list[MultiModalPrompt],
                     params: list[SamplingParams], engine_id: str | None = None) -> list[Part]:
        """Admits one engine request per choice (id `engine_id` or `X-Request-Id`, or `{id}-{index}` for several;
        choice i of a prompt seeded seed + i, as vLLM seeds them); one refused aborts those admitted."""
        assert self.metrics is not None and self.strings is not None
        many = req.n * len(prompts) > 1
        parts: list[Part] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                for j in range(req.n):
                    index = i * req.n + j
                    seeded = p if p.seed is None or j == 0 else dataclasses.replace(p, seed=p.seed + j)
                    request_id = f"{g.request_id}-{index}" if many else engine_id or g.request_id
                    timer = self.metrics.timer(len(prompt.token_ids), seeded.max_tokens)
                    stream = await self.async_engine.generate(request_id, prompt.token_ids, seeded, req.leg,
                                                              prompt.spans or None, req.resume_from, req.continues_chat)
                    choice = Choice(choice_spec(req, index, prompt.token_ids, i, self.strings), self.strings)
                    choice.resumes(req.resume_from.token_ids)
                    parts.append(Part(choice, stream, timer, i, len(prompt.token_ids)))
        except BaseException:
            for part in parts:
                part.stream.abort()
            raise
        return parts

    async def _prompts(self, req: GenerateRequest) -> list[MultiModalPrompt]:
        engine = self.async_engine.llm_engine
        assert engine is not None and self.images is not None
        return await request_prompts(req, engine.tokenizer, self.images, self.max_model_len)

    async def _first(self, stream: RequestStream, prefill: asyncio.Task[Any] | None) -> RequestOutput:
        """A decode leg's first output; with a remote prefill (decode_first), its failure if that comes first."""
        async with self._disconnect_counted():
            try:
                return await (stream.__anext__() if prefill is None else first_output(stream, prefill))
            except BaseException:
                stream.abort()
                raise

    async def _collect(self, shape: ResponseShape, req: GenerateRequest, parts: list[Part]) -> Response:
        async with self._disconnect_counted():
            body, finish_reason = await collect(shape, parts)
        self._count(finish_reason or "none")
        if (handoff := self._handoff(req, shape.request_id, finish_reason)) is not None:
            body[KV_TRANSFER_PARAMS] = handoff.to_dict()
        return jsonify(body)

    def _handoff(self, req: GenerateRequest, request_id: str, finish_reason: str | None) -> PrefillHandoff | None:
        """A prefill leg's answer says where its KV blocks wait for the decode worker's pull. One whose token
        ended the answer, sent by a proxy that then calls no decode worker (`pulled_on_stop: false`), frees
        its blocks now instead of after the abort timeout."""
        engine = self.async_engine.llm_engine
        kv = engine.kv_connector if engine is not None else None
        if kv is None or kv.role != "prefill" or not isinstance(req.leg, PrefillParams):
            return None
        if finish_reason == "stop" and not req.leg.pulled_on_stop:
            kv.discard(request_id)
        return kv.handoff(request_id)

    async def _events(self, shape: ResponseShape, req: GenerateRequest, parts: list[Part]) -> AsyncIterator[bytes]:
        outcome: list[str] = []

        def failed(exc: BaseException) -> dict:
            status, body, _ = error_for(exc)  # no headers: they are sent already
            _log_failure(f"stream {shape.request_id}", exc)
            outcome.append(str(status))
            return body

        async with self._disconnect_counted():
            with self.drain.tracking([part.stream for part in parts]):
                async for event in events(shape, parts, req.include_usage, req.continuous_usage, failed):
                    yield event
        self._count(outcome[0] if outcome else parts[-1].choice.finish_reason or "none")


def _json(body: dict, status: int) -> Response:
    response = jsonify(body)
    response.status_code = status
    return response


def _log_failure(what: str, exc: BaseException) -> None:
    """One line for the worker's own errors, which say what went wrong (a failed KV transfer names its peer);
    a traceback for anything else, which is a bug."""
    if isinstance(exc, WorkerError):
        logger.error("%s failed: %s", what, exc)
    else:
        logger.error("%s failed", what, exc_info=exc)
