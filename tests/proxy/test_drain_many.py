"""Many workers of a role drain at once (a planner flipping most of them to the other role): a leg goes on from
each worker that refuses it to the next, until one takes it, and every request is answered. It used to be sent
once to another worker, and failed when that one refused it too (fake workers; the proxy's health checks far
apart, so it learns of each drain only from a refusal)."""
from __future__ import annotations

import asyncio
from typing import Any, Iterator

import httpx
import pytest

from stack.serving import free_port
from tests.proxy.conftest import Server, start_fake_worker, start_proxy
from tests.proxy.flow_clients import answer


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Server, list[Server], list[Server], Server]]:
    """(proxy, prefill workers, decode workers, single server): of each role, the three that sort first (the
    proxy's rotation order) drain, so that a leg meets two or three of them before the fourth takes it."""
    started: list[Server] = []
    try:
        workers: dict[str, list[Server]] = {}
        for role in ("prefill", "decode"):
            ports = sorted((free_port() for _ in range(4)), key=str)
            workers[role] = [start_fake_worker(role, kv_port=port + 1 if role == "prefill" else None, port=port,
                                               draining=i < 3) for i, port in enumerate(ports)]
            started += workers[role]
        single = start_fake_worker("both")
        started.append(single)
        prefill_flags = [a for p in workers["prefill"] for a in ("--prefill", f"127.0.0.1:{p.port}:{p.port + 1}")]
        proxy = start_proxy([*prefill_flags,
                             *(a for d in workers["decode"] for a in ("--decode", f"127.0.0.1:{d.port}")),
                             "--disaggregation-strategy", "prefill_first", "--health-interval", "600"])
        started.append(proxy)
        yield proxy, workers["prefill"], workers["decode"], single
    finally:
        for server in started:
            server.process.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_leg_goes_on_from_worker_to_worker_until_one_takes_it(stack, stream: bool) -> None:
    proxy, prefills, decodes, single = stack
    body: dict[str, Any] = {"model": "fake-model", "prompt": f"refused three times, streamed {stream}", "max_tokens": 5,
                            "stream": stream}

    async def from_each() -> list[tuple[str, str, dict]]:
        async with httpx.AsyncClient(timeout=30) as client:
            return [await answer(client, server.url, "/v1/completions", body) for server in (single, proxy)]

    want, got = asyncio.run(from_each())
    assert got == want
    for role, workers in (("prefill", prefills), ("decode", decodes)):
        refused = [len(w.state()["legs"]) for w in workers[:3]]
        # the first request's leg met two or three of them; each refused it, left rotation, and saw no other
        assert max(refused) == 1 and sum(refused) >= 2, (role, refused)
        assert workers[3].state()["legs"][-1]["leg"] == role

