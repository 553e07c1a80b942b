"""Image parts on a prefill + decode pair (both legs get the same image_url parts, as the proxy sends
them): the prefill worker computes the prompt as a `both` worker does, and the pair answers exactly
as the `both` worker, for 1, 2 and 5 images."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.di.workers import disaggregated, worker_pair
from tests.worker.multimodal_helpers import image_part, text_part, write_snippet_images
from tests.worker_process import WorkerProcess

Workers = tuple[WorkerProcess, WorkerProcess, WorkerProcess]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Workers]:
    images = tmp_path_factory.mktemp("images")
    write_snippet_images(images, tiny_llama)
    extra = ["--model", str(tiny_llama), "--allowed-local-media-path", str(images)]
    both = WorkerProcess(extra=extra)
    try:
        with worker_pair("shm", extra, extra) as (prefill, decode):
            yield prefill, decode, both
    finally:
        both.stop()


def body(images: list[int], **sampling: Any) -> dict[str, Any]:
    parts = [image_part(f"img{i}.safetensors") for i in images]
    return {"messages": [{"role": "user", "content": [text_part("Describe:"), *parts]}], "max_tokens": 8,
            "temperature": 0, **sampling}


def answer(response: httpx.Response) -> tuple[dict, dict]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"], response.json()["usage"]


async def pair(prefill: WorkerProcess, decode: WorkerProcess, request: dict[str, Any]) -> tuple[dict, dict]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        p_response, d_response = await disaggregated(client, prefill, decode, "/v1/chat/completions", request)
    p_message, p_usage = answer(p_response)
    message, usage = answer(d_response)
    assert p_usage["completion_tokens"] == 1 and message["content"].startswith(p_message["content"])
    return message, usage


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 5])
def test_the_pair_answers_image_prompts_as_a_both_worker(workers: Workers, n: int, sampling: dict) -> None:
    prefill, decode, both = workers
    for images in (list(range(n)), list(range(n - 1)) + [5]):   # then the last image swapped for another
        request = body(images, **sampling)
        expected = answer(httpx.post(f"{both.url}/v1/chat/completions", json=request, timeout=120.0))
        assert asyncio.run(pair(prefill, decode, request)) == expected
        assert asyncio.run(pair(prefill, decode, request)) == expected   # prefill's blocks now cached
    for worker in workers:
        worker.wait_blocks_free()
