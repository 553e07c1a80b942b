"""Many requests at once: each client gets exactly its own answer, and nothing stays in flight."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.helpers import wait_until
from tests.proxy.conftest import Pair


async def _text(client: httpx.AsyncClient, url: str, i: int) -> str:
    stream = i % 2 == 0
    body = {"model": "fake-model", "prompt": f"prompt number {i}", "max_tokens": 3 + i % 5, "stream": stream,
            "fake": {"decode": {"delay": 0.01}}}
    reply = await client.post(f"{url}/v1/completions", json=body)
    assert reply.status_code == 200
    if not stream:
        return reply.json()["choices"][0]["text"]
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


async def _all(url: str, count: int) -> list[str]:
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        return await asyncio.gather(*(_text(client, url, i) for i in range(count)))


def _inflight_legs(url: str) -> list[float]:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("proxy_worker_inflight_requests{")]


def _check(pair: Pair, count: int) -> None:
    via_proxy = asyncio.run(_all(pair.proxy.url, count))
    assert via_proxy == asyncio.run(_all(pair.single.url, count))
    assert all(text.count(" w") == 3 + i % 5 for i, text in enumerate(via_proxy))
    wait_until(lambda: not any(_inflight_legs(pair.proxy.url)), timeout=10, what="no leg in flight")
    assert pair.prefill.state()["active"] == 0 and pair.decode.state()["active"] == 0


def test_concurrent_requests_get_their_own_answers(pair: Pair) -> None:
    _check(pair, 40)


@pytest.mark.slow
def test_many_concurrent_requests(pair: Pair) -> None:
    _check(pair, 400)
