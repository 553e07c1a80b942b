"""--routing kv with real workers publishing KV cache events: 2P2D answers equal one `both` worker's, every
block comes back, and a prompt whose prefix a worker holds goes to that worker."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx
import pytest

from stack.worker_metrics import metric
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.proxy.kv_stack import kv_routed_stack
from tests.worker_process import WorkerProcess

MODEL = "neuron-di-builtin"
SYSTEM = "You are a careful assistant. Answer in one short line of Python.\n" * 3


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Server, list[WorkerProcess]]]:
    with kv_routed_stack(2, 2) as served:
        yield served


def request(i: int) -> tuple[str, dict[str, Any]]:
    """Conversations sharing one system text, greedy and seeded, streamed and not, completions and chat."""
    text = f"{SYSTEM}user {i % 4}: write function number {i}\n"
    sampling = {"temperature": 0.0} if i % 2 else {"temperature": 0.8, "seed": 7 + i}
    body = {"model": MODEL, "max_tokens": 5 + i % 4, "stream": i % 3 == 0, **sampling}
    if i % 4 == 3:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def answer(client: httpx.AsyncClient, url: str, i: int) -> str:
    path, body = request(i)
    reply = await client.post(url + path, json=body)
    assert reply.status_code == 200, reply.text
    if not body["stream"]:
        choice = reply.json()["choices"][0]
        return choice.get("text") or choice["message"]["content"]
    out = []
    for line in reply.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


async def both_ways(proxy: Server, single: WorkerProcess, n: int) -> tuple[list[str], list[str]]:
    async with httpx.AsyncClient(timeout=120) as client:
        routed = await asyncio.gather(*(answer(client, proxy.url, i) for i in range(n)))
        alone = await asyncio.gather(*(answer(client, single.url, i) for i in range(n)))
    return list(routed), list(alone)


def test_kv_routed_answers_equal_one_both_worker(stack: tuple[Server, list[WorkerProcess]]) -> None:
    proxy, workers = stack
    for _ in range(2):   # the second round finds the first round's prefixes in the indexes
        routed, alone = asyncio.run(both_ways(proxy, workers[-1], 16))
        assert routed == alone
    for worker in workers:
        worker.wait_blocks_free()
    assert metric(proxy.url, "proxy_kv_index_blocks", 0.0) > 0
    assert metric(proxy.url, "proxy_kv_route_tokens_total", 0.0, kind="hit") > 0
    assert metric(proxy.url, "proxy_kv_event_bad_frames_total", 0.0) == 0


def test_a_prompt_goes_where_its_prefix_is(stack: tuple[Server, list[WorkerProcess]]) -> None:
    proxy = stack[0]
    body = {"model": MODEL, "prompt": SYSTEM + "a conversation of its own, turn 1\n", "max_tokens": 3,
            "temperature": 0.0}
    hits = metric(proxy.url, "proxy_kv_route_tokens_total", 0.0, kind="hit")
    batches = metric(proxy.url, "proxy_kv_event_batches_total", 0.0)
    with httpx.Client(timeout=60) as client:
        assert client.post(f"{proxy.url}/v1/completions", json=body).status_code == 200
        # The prefill worker computed the new blocks, the decode worker pulled them: both told the proxy.
        wait_until(lambda: metric(proxy.url, "proxy_kv_event_batches_total", 0.0) >= batches + 2, timeout=10)
        before = {k: metric(proxy.url, "proxy_kv_route_tokens_total", 0.0, kind=k) for k in ("hit", "best")}
        for turn in range(2, 5):
            body["prompt"] += f"turn {turn}\n"
            assert client.post(f"{proxy.url}/v1/completions", json=body).status_code == 200
        after = {k: metric(proxy.url, "proxy_kv_route_tokens_total", 0.0, kind=k) for k in ("hit", "best")}
    assert after["hit"] - before["hit"] == after["best"] - before["best"] > 0
    assert hits < after["hit"]


def test_conditional_reads_the_decode_workers_cache_from_its_events(stack: tuple[Server, list[WorkerProcess]]) -> None:
    """A second proxy, conditional and KV-routed: a long prompt goes remote; the same prompt grown by a few
    tokens stays on the decode worker that pulled it, whose events say it holds all but those tokens."""
    _, workers = stack
    p1, p2, d1, d2, _ = workers
    proxy = start_proxy([f"--prefill=127.0.0.1:{p1.port}:{p1.kv_port}", f"--prefill=127.0.0.1:{p2.port}:{p2.kv_port}",
                         f"--decode=127.0.0.1:{d1.port}", f"--decode=127.0.0.1:{d2.port}", "--routing", "kv",
                         "--tokenizer", "builtin", "--conditional-disaggregation", "--max-local-prefill-tokens", "48"])
    try:
        prompt = "conditional: " + "def add(a, b):\n    return a + b\n\n" * 6
        with httpx.Client(timeout=60) as client:
            sent = iter(range(1000))

            def heard() -> bool:   # the proxy's subscriptions join late: new blocks until it heard of some
                warm = f"warm-up {next(sent)}: " + "y = 1\n" * 30
                client.post(f"{proxy.url}/v1/completions", json={"model": MODEL, "prompt": warm, "max_tokens": 1})
                return metric(proxy.url, "proxy_kv_event_batches_total", 0.0) > 0

            wait_until(heard, timeout=30, interval=0.2)
            for text in (prompt, prompt + "# more"):
                batches = metric(proxy.url, "proxy_kv_event_batches_total", 0.0)
                reply = client.post(f"{proxy.url}/v1/completions",
                                    json={"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0.0})
                assert reply.status_code == 200, reply.text
                if text == prompt:   # the decode worker pulled its blocks and said so
                    wait_until(lambda: metric(proxy.url, "proxy_kv_event_batches_total", 0.0) > batches, timeout=10)
        paths = {k: metric(proxy.url, "proxy_request_paths_total", 0.0, path=k) for k in ("local", "remote")}
        assert paths["remote"] >= 1 and paths["local"] >= 1, paths
    finally:
        proxy.process.stop()
