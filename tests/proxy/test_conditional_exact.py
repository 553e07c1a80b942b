"""Conditional disaggregation with real workers: short prompts served by the decode worker alone, long
ones prefilled by the prefill worker, and every answer what one `both` worker gives."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Iterator

import httpx
import pytest

from tests.proxy.flow_clients import paths
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers, stop_together

MODEL = "neuron-di-builtin"
MAX_LOCAL = 48  # prompt tokens; the built-in model's tokenizer makes one token per byte
CODE = "def add(a, b):\n    return a + b\n\n"


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Server, list[WorkerProcess]]]:
    workers: list[WorkerProcess] = []
    proxy: Server | None = None
    try:
        workers = start_workers(*((role, "shm", ()) for role in ("prefill", "decode", "both")))
        prefill, decode, _ = workers
        proxy = start_proxy(["--prefill", f"127.0.0.1:{prefill.port}:{prefill.kv_port}",
                             "--decode", f"127.0.0.1:{decode.port}", "--conditional-disaggregation",
                             "--tokenizer", "builtin", "--max-local-prefill-tokens", str(MAX_LOCAL)])
        yield proxy, workers
    finally:
        stop_together(proxy.process if proxy is not None else None, *workers)


@pytest.fixture(autouse=True)
def blocks_free_after(stack: tuple[Server, list[WorkerProcess]]) -> Iterator[None]:
    yield
    for worker in stack[1]:
        worker.wait_blocks_free()


def request(i: int, run: int) -> tuple[str, dict[str, Any]]:
    """The i-th request of the mix: short and long prompts, completions and chat, greedy and seeded,
    streamed and not. Each `run` has prompts of its own: a decode worker caches the blocks it was sent."""
    text = f"# run {run}, snippet {i}\n" + (CODE * 4 if i % 2 else "x = ")   # long: > MAX_LOCAL tokens
    sampling = {"temperature": 0.0} if i % 4 < 2 else {"temperature": 0.9, "seed": 1000 + i}
    body = {"model": MODEL, "max_tokens": 6 + i % 5, "stream": i % 3 == 0, **sampling}
    if i % 8 >= 4:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def answer(client: httpx.AsyncClient, url: str, i: int, run: int) -> str:
    path, body = request(i, run)
    reply = await client.post(url + path, json=body)
    assert reply.status_code == 200, reply.text
    if not body["stream"]:
        choice = reply.json()["choices"][0]
        return choice["message"]["content"] if "messages" in body else choice["text"]
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e)["choices"] for e in events[:-1]]
    return "".join(c[0].get("delta", {}).get("content") or c[0].get("text") or "" for c in chunks if c)


async def answers(url: str, count: int, concurrency: int) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(i: int) -> str:
            async with gate:
                return await answer(client, url, i, concurrency)
        return list(await asyncio.gather(*(one(i) for i in range(count))))


def timed_paths(proxy: Server) -> dict[str, int]:
    """The requests whose phases the proxy observed so far, by (flow, path): "local" or "remote"."""
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    found = re.findall(r'^proxy_phase_seconds_count\{flow="(\w+)",path="(\w+)",phase="request"\} (\S+)$', metrics, re.M)
    assert all((flow == "local") == (path == "local") for flow, path, _ in found), found
    counts: dict[str, int] = {}
    for _, path, n in found:
        counts[path] = counts.get(path, 0) + int(float(n))
    return counts


@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_mix_of_local_and_remote_requests_answers_as_one_worker(stack: tuple[Server, list[WorkerProcess]],
                                                                   concurrency: int) -> None:
    proxy, (_, _, both) = stack
    before, timed_before = paths(proxy), timed_paths(proxy)
    via_proxy = asyncio.run(answers(proxy.url, 16, concurrency))
    after, timed_after = paths(proxy), timed_paths(proxy)
    assert via_proxy == asyncio.run(answers(both.url, 16, concurrency))
    taken = {path: after[path] - before.get(path, 0) for path in after}
    assert taken["local"] > 0 and taken["remote"] > 0 and sum(taken.values()) == 16, taken
    # Each request's phases are observed once, under the path it took (the local ones' flow: local).
    assert {path: timed_after[path] - timed_before.get(path, 0) for path in timed_after} == taken
    if concurrency == 1:  # the prefill side is idle for each: the prompt's length alone decides
        assert taken == {"local": 8, "remote": 8}
