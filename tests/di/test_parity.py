"""A prefill + decode pair answers exactly as one worker of role `both` does."""
from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest

from tests.di.workers import disaggregated
from tests.worker_process import WorkerProcess

pytestmark = pytest.mark.usefixtures("blocks_free_after")

NUM_PROMPTS = 50
MAX_TOKENS = 8


def prompts() -> list[list[int]]:
    """50 token-id prompts whose lengths spread over 1..1000."""
    rng = random.Random(7)
    lengths = [1 + round(i * 999 / (NUM_PROMPTS - 1)) for i in range(NUM_PROMPTS)]
    return [[rng.randrange(32, 127) for _ in range(n)] for n in lengths]


def body(prompt: list[int], **sampling: Any) -> dict[str, Any]:
    return {"model": "neuron-di-builtin", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **sampling}


def answer(response: httpx.Response) -> tuple[str, str, int]:
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    return choice["text"], choice["finish_reason"], data["usage"]["completion_tokens"]


async def gather_limited(concurrency: int, coros: list) -> list:
    gate = asyncio.Semaphore(concurrency)

    async def run(coro):
        async with gate:
            return await coro
    return await asyncio.gather(*(run(c) for c in coros))


async def both_answers(worker: WorkerProcess, bodies: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        responses = await gather_limited(1, [client.post(f"{worker.url}/v1/completions", json=b) for b in bodies])
    return [answer(r) for r in responses]


async def pair_answers(prefill: WorkerProcess, decode: WorkerProcess, bodies: list[dict[str, Any]],
                       concurrency: int) -> list[tuple[str, str, int]]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        legs = await gather_limited(concurrency, [disaggregated(client, prefill, decode, "/v1/completions", b)
                                                  for b in bodies])
    results = []
    for p_response, d_response in legs:
        p_text, _, p_tokens = answer(p_response)
        d = answer(d_response)
        assert p_tokens == 1 and d[0].startswith(p_text)  # the decode side's first token is prefill's
        results.append(d)
    return results


@pytest.fixture(scope="module")
def greedy_reference(both_worker: WorkerProcess) -> list[tuple[str, str, int]]:
    return asyncio.run(both_answers(both_worker, [body(p) for p in prompts()]))


# One at a time with --full: sixteen at once takes the same paths, batched.
CONCURRENCY = [pytest.param(1, marks=pytest.mark.slow), 16]


@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_greedy_parity(pair: tuple[WorkerProcess, WorkerProcess], greedy_reference: list, concurrency: int) -> None:
    got = asyncio.run(pair_answers(*pair, [body(p) for p in prompts()], concurrency))
    mismatches = [(i, len(p), want, have) for i, (p, want, have)
                  in enumerate(zip(prompts(), greedy_reference, got)) if want != have]
    assert not mismatches, json.dumps(mismatches[:5])
    assert all(n == MAX_TOKENS for _, _, n in got)


def seeded_bodies() -> list[dict[str, Any]]:
    """Sampled requests, each with its own seed: every sampling mode the sampler has."""
    modes = [{"temperature": 0.8}, {"temperature": 1.0, "top_k": 20}, {"temperature": 0.7, "top_p": 0.9}]
    return [body(p, seed=1000 + i, **modes[i % len(modes)]) for i, p in enumerate(prompts()[::3])]


@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_seeded_sampling_parity(pair: tuple[WorkerProcess, WorkerProcess], both_worker: WorkerProcess, concurrency: int) -> None:
    want = asyncio.run(both_answers(both_worker, seeded_bodies()))
    got = asyncio.run(pair_answers(*pair, seeded_bodies(), concurrency))
    assert got == want
    assert len({text for text, _, _ in want}) > len(want) // 2  # really sampled, not one fixed string
