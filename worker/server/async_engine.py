"""AsyncEngine: runs the single-threaded LLMEngine on its own thread and serves it to asyncio code.

Every call into the engine happens on that thread. The event loop talks to it through a
thread-safe inbox of commands (add, abort, stop); the thread hands each step's outputs back to
their requests' asyncio.Queues with one `loop.call_soon_threadsafe` per event loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from common.handoff import LegParams
from common.stream_resume import Resumed
from worker.engine.llm_engine import EngineStats, LLMEngine
from worker.engine.request import RequestOutput
from worker.errors import WorkerError
from worker.multimodal.embeds import ImageEmbeds
from worker.server.loop_delivery import Sink, deliver, deliver_all, settle
from worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # how long an idle engine thread sleeps on the inbox before re-checking `stopping`


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    admitted: asyncio.Future[None]
    leg: LegParams | None = None
    mm: list[tuple[int, ImageEmbeds]] | None = None
    resumed: Resumed = Resumed()
    continues_chat: bool = False


@dataclass(frozen=True)
class _Abort:
    request_id: str
    last: Callable[[LLMEngine, str], BaseException] | None = None   # made on the engine thread: the stream's end


class _Stop:
    pass


class _Wake:
    """Sent by the KV connector's thread: blocks were released, let the engine step."""


@dataclass(frozen=True)
class _Rebuild:
    """Replace the idle engine by the first of `factories` that builds one; `built` gets its index."""

    factories: Sequence[Callable[[], LLMEngine]]
    built: asyncio.Future[int]
    loop: asyncio.AbstractEventLoop


class RequestStream:
    """The outputs of one admitted request, in order, until one is `finished`.

    Leaving early (cancellation, `aclose()`, an exception in `async with`) aborts the request so
    the engine frees its blocks.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, sink: Sink) -> None:
        self.request_id = request_id
        self._sink = sink
        self._done = False
        # A stream dropped before anyone iterated it (e.g. the client left before the body started)
        # still aborts its request when it is garbage collected.
        self._abort = weakref.finalize(self, engine.abort, request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._sink.queue.get()
        except BaseException:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    def _finish(self) -> None:
        self._done = True
        self._abort.detach()

    def hand_back(self, error: BaseException) -> None:
        """Aborts the request; the outputs already queued are read first, then `error` is raised."""
        self._sink.queue.put_nowait(error)
        self._abort()

    def hand_off(self, engine: AsyncEngine, last: Callable[[LLMEngine, str], BaseException]) -> None:
        """Ends the request between two steps: the outputs it has are read first, then what `last` makes of it
        on the engine thread (worker/server/hand_back.py)."""
        self._abort.detach()
        engine.abort(self.request_id, last)

    def abort(self) -> None:
        """Aborts the request unless it already ended; idempotent."""
        self._done = True
        self._abort()  # a finalize callback runs at most once, and never after detach()

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.abort()


class AsyncEngine:
    """Owns the engine thread; `await start()`, then `generate()` from any coroutine, then `stop()`."""

    def __init__(self, factory: Callable[[], LLMEngine], thread_name: str = "engine") -> None:
        self._factory = factory
        self._thread_name = thread_name
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop | _Wake | _Rebuild] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.llm_engine: LLMEngine | None = None
        self.stats: EngineStats | None = None  # refreshed by the engine thread after every change
        self.rebuild_error: str | None = None  # why the last rebuild's first factory failed

    async def start(self) -> None:
        """Builds the engine on its thread (model loading included) and waits until it is ready."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(target=self._main, args=(loop, ready), name=self._thread_name,
                                        daemon=True)
        self._thread.start()
        try:
            await ready
        except BaseException:
            # The thread is on its way out; joined here, it has let go of the half-built engine before the
            # caller goes on (a process exiting while a daemon thread frees tensors aborts).
            await loop.run_in_executor(None, self._thread.join, 30.0)
            raise

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def close_soon(self) -> None:
        """Asks the thread to stop, without waiting for it; requests still in flight fail with WorkerError."""
        self._stopping.set()
        self._inbox.put(_Stop())

    async def stop(self, timeout: float = 30.0) -> None:
        """Stops the thread and joins it; requests still in flight fail with WorkerError."""
        if self._thread is None:
            return
        self.close_soon()
        thread, self._thread = self._thread, None
        await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout)
        if thread.is_alive():
            logger.error("engine thread did not stop within %.0f s", timeout)

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                       leg: LegParams | None = None,
                       mm: list[tuple[int, ImageEmbeds]] | None = None, resumed: Resumed = Resumed(),
                       continues_chat: bool = False) -> RequestStream:
        """Admits a request and returns its output stream; admission errors (queue full, invalid) raise here.

        A request that fails later (e.g. its KV transfer) raises its error from the stream. `continues_chat`:
        see LLMEngine.add_request.
        """
        if not self.is_alive():
            raise WorkerError("the engine is not running")
        loop = asyncio.get_running_loop()
        sink = Sink(loop, asyncio.Queue())
        admitted: asyncio.Future[None] = loop.create_future()
        self._inbox.put(_Add(request_id, list(prompt_ids), params, sink, admitted, leg, mm, resumed, continues_chat))
        try:
            await self._admission(admitted)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been admitted after all
            raise
        finally:
            # Nobody awaits the answer any more. Cancelled, the future drops a later one (settle skips
            # it); one already there is marked read. Else an error the caller missed by being cancelled
            # (e.g. an invalid prompt) would be logged as "Future exception was never retrieved".
            if not admitted.cancel():
                admitted.exception()
        return RequestStream(self, request_id, sink)

    async def _admission(self, admitted: asyncio.Future[None]) -> None:
        # Re-checks the thread now and then: a command put after its final drain is never answered.
        while not admitted.done():
            await asyncio.wait({admitted}, timeout=1.0)
            if not admitted.done() and not self.is_alive():
                raise WorkerError("the engine stopped")
        admitted.result()

    def abort(self, request_id: str, last: Callable[[LLMEngine, str], BaseException] | None = None) -> None:
        """Aborts a request if it is still in flight; safe from any thread, any number of times. `last`: its
        stream ends with what `last(engine, request_id)` returns, on the engine thread before the abort."""
        self._inbox.put(_Abort(request_id, last))

    async def rebuild(self, factories: Sequence[Callable[[], LLMEngine]]) -> int:
        """Closes the engine, which must hold no request, and runs the first of `factories` that builds one;
        its index. WorkerError if the engine is busy or stopped, or none builds (the thread then stops)."""
        if not self.is_alive():
            raise WorkerError("the engine is not running")
        loop = asyncio.get_running_loop()
        built: asyncio.Future[int] = loop.create_future()
        self._inbox.put(_Rebuild(list(factories), built, loop))
        return await built

    # ---- engine thread ------------------------------------------------------------------------

    def _main(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[None]) -> None:
        try:
            self._use(self._factory())
        except Exception as exc:  # e.g. ModelLoadError, or a config the model cannot honour
            deliver(loop, settle, ready, WorkerError(f"engine failed to start: {exc}"))
            return
        deliver(loop, settle, ready, None)
        reason = "the engine is shutting down"
        try:
            self._loop()
        except BaseException as exc:  # a bug in this loop must not leave requests hanging
            logger.exception("engine thread crashed")
            reason = f"engine thread crashed: {exc}"
        finally:
            self._stopping.set()
            self._close(WorkerError(reason))
            self._engine.close()

    def _use(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        self.stats = engine.stats()
        if engine.kv_connector is not None:
            engine.kv_connector.wake = lambda: self._inbox.put(_Wake())

    def _loop(self) -> None:
        failed = False
        while not self._stopping.is_set():
            # After a failed step, wait for a command before retrying instead of spinning on the fault.
            wait = self._engine.wait_hint()
            self._drain(IDLE_WAIT_S if failed or wait is None else wait)
            engine = self._engine   # a command (a rebuild) may have replaced it
            if self._stopping.is_set():
                return
            failed = engine.has_unfinished_requests() and not self._step(engine)
            self.stats = engine.stats()

    @property
    def _engine(self) -> LLMEngine:
        assert self.llm_engine is not None   # built before the loop starts, and never unset
        return self.llm_engine

    def _drain(self, timeout: float) -> None:
        """Runs every queued command, first waiting up to `timeout` seconds for one to arrive."""
        try:
            command = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self, command: _Add | _Abort | _Stop | _Wake | _Rebuild) -> None:
        if isinstance(command, _Rebuild):
            self._rebuild(command)
        elif isinstance(command, _Add):
            self._add(self._engine, command)
        elif isinstance(command, _Abort):
            # Also for a request that has ended here: a prefill leg's KV may still be held for a pull.
            sink = self._sinks.pop(command.request_id, None)
            if sink is not None and command.last is not None:
                deliver_all([(sink, command.last(self._engine, command.request_id))])
            self._engine.abort_request(command.request_id)
        elif isinstance(command, _Stop):
            self._stopping.set()

    def _rebuild(self, command: _Rebuild) -> None:
        old = self._engine
        if old.has_unfinished_requests() or self._sinks or self._stopping.is_set():
            deliver(command.loop, settle, command.built, WorkerError("the engine is busy or stopping"))
            return
        old.close()
        self.rebuild_error = None
        for index, factory in enumerate(command.factories):
            try:
                engine = factory()
            except Exception as exc:  # noqa: BLE001 - try the next one (the role it had)
                logger.exception("building an engine failed")
                self.rebuild_error = self.rebuild_error or str(exc)
                continue
            engine.counters = old.counters   # running totals go on across roles
            self._use(engine)
            deliver(command.loop, settle, command.built, index)
            return
        self._stopping.set()   # the closed engine stays as `llm_engine` (its names, for the last answers)
        deliver(command.loop, settle, command.built,
                WorkerError(f"no engine could be built: {self.rebuild_error}"))

    def _add(self, engine: LLMEngine, command: _Add) -> None:
        error: BaseException | None = None
        try:
            engine.add_request(command.request_id, command.prompt_ids, command.params,
                               command.leg, command.mm, command.resumed, continues_chat=command.continues_chat)
            self._sinks[command.request_id] = command.sink
            self.stats = engine.stats()  # before the caller hears of it: a drain must see it in flight
        except Exception as exc:  # QueueFullError / InvalidRequestError (e.g. a duplicate id) go to the caller
            error = exc
        deliver(command.sink.loop, settle, command.admitted, error)

    def _step(self, engine: LLMEngine) -> bool:
        """One engine step, its outputs delivered; False if the step raised (its requests are failed)."""
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.exception("engine step failed")
            self._fail_all(WorkerError(f"engine step failed: {exc}"), engine)
            return False
        ready: list[tuple[Sink, RequestOutput | BaseException]] = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:  # aborted while the step ran
                continue
            if output.finished:
                del self._sinks[output.request_id]
            ready.append((sink, output if output.error is None else output.error))
        deliver_all(ready)
        return True

    def _fail_all(self, error: WorkerError, engine: LLMEngine | None = None) -> None:
        """Ends every in-flight request with `error`, aborting it in the engine so its blocks are freed."""
        sinks, self._sinks = self._sinks, {}
        for request_id in sinks:
            if engine is not None:
                try:
                    engine.abort_request(request_id)
                except Exception:
                    logger.exception("could not abort %s after an engine failure", request_id)
        deliver_all((sink, error) for sink in sinks.values())

    def _close(self, error: WorkerError) -> None:
        """Fails everything in flight or still queued, so no caller waits on a stopped thread."""
        self._fail_all(error)
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                deliver(command.sink.loop, settle, command.admitted, error)
