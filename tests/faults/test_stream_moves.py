"""Streams that survive their decode worker: 1P2D behind `proxy_server.py --resume-streams`.

A decode worker killed with SIGKILL mid-stream, then one drained (`--drain-hands-back-streams`):
every stream completes, and its text, finish reason and usage are those of one `both` worker's
answer to the same request, greedy and seeded alike (no token lost or repeated at the move).
"""
from __future__ import annotations

import asyncio
import time
from typing import Iterator

import httpx
import pytest

from stack.worker_metrics import metric
from tests.faults.stream_clients import Streamed, bodies, reference, run_streams
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers, stop_together

DECODE_FLAGS = ["--drain-hands-back-streams", "--drain-timeout", "60"]
STREAMS, TOKENS = 8, 96


class Stack:
    def __init__(self) -> None:
        self.workers: list[WorkerProcess] = []
        self.proxy: Server | None = None

    def start(self) -> None:
        self.workers = start_workers(("prefill", "shm", ()), ("decode", "shm", DECODE_FLAGS),
                                     ("decode", "shm", DECODE_FLAGS), ("both", "shm", ()))
        self.prefill, *self.decodes, self.both = self.workers
        self.proxy = start_proxy(["--prefill", f"127.0.0.1:{self.prefill.port}:{self.prefill.kv_port}",
                                  *[f"--decode=127.0.0.1:{d.port}" for d in self.decodes],
                                  "--resume-streams", "--health-interval", "0.5"])
        self.wait_decodes(2)

    def _add(self, worker: WorkerProcess) -> WorkerProcess:
        self.workers.append(worker)
        return worker

    def wait_decodes(self, count: int) -> None:
        assert self.proxy is not None
        wait_until(lambda: httpx.get(f"{self.proxy.url}/health", timeout=5).json()["workers"]["decode"]["healthy"]
                   == count, timeout=30, what=f"{count} healthy decode workers")

    def stop(self) -> None:
        stop_together(self.proxy.process if self.proxy is not None else None, *self.workers)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    started = Stack()
    try:
        started.start()
        yield started
    finally:
        started.stop()


def _under_load(stack: Stack, act: "callable[[], None]", count: int = STREAMS,
                tokens: int = TOKENS) -> tuple[list[Streamed], list[Streamed]]:
    """`count` streams through the proxy; `act()` once every one has shown a few tokens; the streams and
    the `both` worker's answers to the same requests."""
    assert stack.proxy is not None
    model = httpx.get(f"{stack.both.url}/v1/models", timeout=10).json()["data"][0]["id"]
    requests = bodies(model, count, tokens, chat_every=4)
    progress = [0] * count

    async def run() -> list[Streamed]:
        streams = asyncio.ensure_future(run_streams(stack.proxy.url, requests, progress))
        await asyncio.to_thread(wait_until, lambda: min(progress) >= 4 or streams.done(), 60, 0.01, "tokens")
        assert not streams.done(), "the streams ended before the fault: make them longer"
        await asyncio.to_thread(act)
        return await streams

    got = asyncio.run(run())
    want = asyncio.run(reference(stack.both.url, requests))
    return got, want


def _assert_exact(got: list[Streamed], want: list[Streamed]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert not g.errors, (i, g.errors)
        assert (g.text, g.finish_reason) == (w.text, w.finish_reason), i
        assert g.usage is not None and w.usage is not None
        assert (g.usage["prompt_tokens"], g.usage["completion_tokens"]) == \
               (w.usage["prompt_tokens"], w.usage["completion_tokens"]), i


def _busiest(stack: Stack, picked: list[WorkerProcess]) -> WorkerProcess:
    """The decode worker running the most streams (on a loaded host the proxy may have sent every stream to one
    of the two, its health check of the other late), added to `picked`."""
    busiest = max(stack.decodes, key=lambda w: metric(w.url, "neuron_di_requests_running", 0.0))
    picked.append(busiest)
    return busiest


def _kill_one(stack: Stack, count: int, tokens: int) -> None:
    """SIGKILL to a decode worker mid-stream; it is started again afterwards."""
    assert stack.proxy is not None
    picked: list[WorkerProcess] = []
    got, want = _under_load(stack, lambda: _busiest(stack, picked).proc.kill(), count, tokens)
    _assert_exact(got, want)
    moved, [victim] = [g for g in got if g.moves], picked
    assert moved, "no stream was on the killed worker mid-answer"
    assert metric(stack.proxy.url, "proxy_stream_moves_total", 0.0, reason="worker_lost") >= len(moved)
    for worker in (stack.prefill, *(w for w in stack.decodes if w is not victim)):
        worker.wait_blocks_free(timeout=15)
    print(f"\nkill -9, {count} streams of {tokens} tokens: {len(moved)} moved; largest gap a client saw: "
          f"{max(g.largest_gap for g in moved) * 1000:.0f} ms")
    stack.decodes[stack.decodes.index(victim)] = stack._add(victim.restarted())
    stack.wait_decodes(2)


def _drain_one(stack: Stack, count: int, tokens: int, again: bool = True) -> None:
    """POST /drain to a decode worker mid-stream: it hands its streams back and exits; started `again` after."""
    assert stack.proxy is not None
    took: list[float] = []
    picked: list[WorkerProcess] = []

    def drain() -> None:
        drained = _busiest(stack, picked)
        started = time.monotonic()
        assert httpx.post(f"{drained.url}/drain", timeout=10).status_code == 202
        assert drained.proc.proc.wait(timeout=60) == 0, drained.proc.tail()
        took.append(time.monotonic() - started)

    before = metric(stack.proxy.url, "proxy_stream_moves_total", 0.0, reason="handed_back")
    got, want = _under_load(stack, drain, count, tokens)
    _assert_exact(got, want)
    moved, [drained] = [g for g in got if g.moves], picked
    assert moved and "handed back" in drained.proc.output()
    assert metric(stack.proxy.url, "proxy_stream_moves_total", 0.0, reason="handed_back") - before >= len(moved)
    for worker in (stack.prefill, *(w for w in stack.decodes if w is not drained)):
        worker.wait_blocks_free(timeout=15)
    print(f"\ndrain, {count} streams of {tokens} tokens: {len(moved)} handed back; the worker exited "
          f"{took[0]:.2f} s after POST /drain; largest gap a client saw: "
          f"{max(g.largest_gap for g in moved) * 1000:.0f} ms")
    if again:
        stack.decodes[stack.decodes.index(drained)] = stack._add(drained.restarted())
        stack.wait_decodes(2)


@pytest.mark.slow
def test_sixteen_long_streams_survive_a_killed_decode_worker(stack: Stack) -> None:
    _kill_one(stack, 16, 512)


@pytest.mark.slow
def test_sixteen_long_streams_survive_a_drained_decode_worker(stack: Stack) -> None:
    _drain_one(stack, 16, 512)


def test_streams_of_a_killed_decode_worker_go_on_elsewhere_exactly(stack: Stack) -> None:
    _kill_one(stack, STREAMS, TOKENS)


def test_a_draining_decode_worker_hands_its_streams_back(stack: Stack) -> None:
    _drain_one(stack, STREAMS, TOKENS, again=False)  # the module's last test: nothing needs the worker after
