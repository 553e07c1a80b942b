"""The engine thread under failure and shutdown: through an in-process server (hypercorn on a free
port) and through AsyncEngine directly.

The engine is the real LLMEngine on the built-in model; two tests inject a fault into its step().
"""
from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Callable, Iterator

import httpx
import pytest

from stack.worker_metrics import metric
from tests.helpers import wait_until
from tests.worker.server_helpers import InProcessServer
from worker.server.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.engine.llm_engine import LLMEngine, RequestOutput
from worker.errors import WorkerError
from worker.sampling_params import SamplingParams
from worker.server.app import create_app


class FaultInjectedEngine(LLMEngine):
    """The real engine, except that step() raises once `fail` is set."""

    fail = threading.Event()

    def step(self) -> list[RequestOutput]:
        if self.fail.is_set():
            raise RuntimeError("injected fault")
        return super().step()


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    config = EngineConfig()
    app = create_app(config, engine_factory=lambda: FaultInjectedEngine(config))
    served = InProcessServer(app)
    try:
        yield served
    finally:
        served.stop()
    # after_serving joined the engine thread
    assert not app.extensions["neuron_di_worker"].async_engine.is_alive()
    assert not any(t.name == "engine" for t in threading.enumerate())


@pytest.fixture(autouse=True)
def healthy_engine() -> Iterator[None]:
    FaultInjectedEngine.fail.clear()
    yield
    FaultInjectedEngine.fail.clear()


def test_engine_failure_is_500_for_the_request_then_serving_resumes(server: InProcessServer) -> None:
    FaultInjectedEngine.fail.set()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "engine step failed: injected fault", "type": "server_error",
                                  "param": None, "code": 500}}
    FaultInjectedEngine.fail.clear()
    wait_until(lambda: metric(server.url, "neuron_di_kv_blocks_used") == 0, timeout=30, what="blocks freed")
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event(server: InProcessServer) -> None:
    body = {"prompt": "Keep going", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert r.status_code == 200 and next(lines).startswith("data: {")
        FaultInjectedEngine.fail.set()
        rest = [line for line in lines if line]
    assert rest[-2:] == ['data: {"error":{"message":"engine step failed: injected fault","type":"server_error",'
                         '"param":null,"code":500}}', "data: [DONE]"]
    FaultInjectedEngine.fail.clear()
    wait_until(lambda: metric(server.url, "neuron_di_kv_blocks_used") == 0, timeout=30, what="blocks freed")
    assert metric(server.url, "neuron_di_requests_total", outcome="500") >= 1


def blocks_free(engine: AsyncEngine) -> bool:
    stats = engine.stats
    return stats is not None and stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


async def poll(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_a_stream_dropped_unread_is_aborted() -> None:
    async def run() -> None:
        engine = AsyncEngine(lambda: LLMEngine(EngineConfig()))
        await engine.start()
        try:
            stream = await engine.generate("dropped", [5, 6, 7], SamplingParams(max_tokens=1500, ignore_eos=True))
            await poll(lambda: not blocks_free(engine))
            del stream  # never iterated: garbage collection must still abort it
            gc.collect()
            await poll(lambda: blocks_free(engine))
        finally:
            await engine.stop()

    asyncio.run(run())


def test_stop_ends_in_flight_streams_with_an_error_and_joins_the_thread() -> None:
    async def run() -> None:
        engine = AsyncEngine(lambda: LLMEngine(EngineConfig()), thread_name="engine-stop-test")
        await engine.start()
        stream = await engine.generate("long", [5, 6, 7], SamplingParams(max_tokens=1500, ignore_eos=True))
        first = await stream.__anext__()
        assert first.request_id == "long" and len(first.new_token_ids) == 1
        await engine.stop()
        with pytest.raises(WorkerError, match="the engine is shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(WorkerError, match="the engine is not running"):
            await engine.generate("late", [5], SamplingParams())

    asyncio.run(run())
    assert not any(t.name == "engine-stop-test" for t in threading.enumerate())


def test_a_refusal_the_cancelled_caller_never_read_is_not_logged_as_never_retrieved() -> None:
    entered, gate = threading.Event(), threading.Event()

    class GatedEngine(LLMEngine):
        """The real engine, except that admitting request "gated" waits for `gate`."""

        def add_request(self, request_id: str, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            if request_id == "gated":
                entered.set()
                gate.wait(timeout=30)
            super().add_request(request_id, *args, **kwargs)

    async def run() -> list[str]:
        reported: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context["message"]))
        engine = AsyncEngine(lambda: GatedEngine(EngineConfig()))
        await engine.start()
        try:
            caller = asyncio.ensure_future(engine.generate("gated", [10**6], SamplingParams()))  # not in the vocabulary
            await poll(entered.is_set)
            caller.cancel()  # the client left (as the proxy's cancelled decode leg does) before the refusal
            with pytest.raises(asyncio.CancelledError):
                await caller
            gate.set()
            # Commands and their answers keep their order: once a later request is admitted, the refusal came.
            async for _ in await engine.generate("after", [5], SamplingParams(max_tokens=1)):
                pass
            gc.collect()  # an unread exception is reported when its future is collected
        finally:
            await engine.stop()
        return reported

    assert asyncio.run(run()) == []
