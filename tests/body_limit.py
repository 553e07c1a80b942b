"""A body over the server's size limit (Quart's MAX_CONTENT_LENGTH, 16 MiB) must reach the
clients users run as a 413 with an OpenAI-style error, not as a connection reset: httpx and the
openai client write the whole body before they read the answer."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai

MODEL = "neuron-di-builtin"
OVER_LIMIT = "x" * 20_000_000


def _check_error_body(raw: dict) -> None:
    error = raw["error"]
    assert error["code"] == 413 and error["type"] == "invalid_request_error", raw
    assert "exceeds the capacity limit" in error["message"], raw


def assert_clients_see_413(base_url: str) -> None:
    """httpx (sync and async) and the openai client (sync and async), each twice on one
    connection pool, get the 413 and its JSON body."""
    body = json.dumps({"model": MODEL, "prompt": OVER_LIMIT, "max_tokens": 1}).encode()
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as client:
        for _ in range(2):
            reply = client.post(f"{base_url}/v1/completions", content=body, headers=headers)
            assert reply.status_code == 413
            _check_error_body(reply.json())

    async def async_httpx() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(f"{base_url}/v1/completions", content=body, headers=headers)
                                          for _ in range(2)])
    for reply in asyncio.run(async_httpx()):
        assert reply.status_code == 413
        _check_error_body(reply.json())

    sync = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    for _ in range(2):
        try:
            sync.completions.create(model=MODEL, prompt=OVER_LIMIT, max_tokens=1)
        except openai.APIStatusError as exc:
            assert exc.status_code == 413
            _check_error_body(exc.response.json())
        else:
            raise AssertionError("a body over the limit was served")

    async def async_openai() -> list[BaseException | object]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        return await asyncio.gather(*[client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": OVER_LIMIT}], max_tokens=1) for _ in range(2)],
            return_exceptions=True)
    for outcome in asyncio.run(async_openai()):
        assert isinstance(outcome, openai.APIStatusError) and outcome.status_code == 413, outcome
        _check_error_body(outcome.response.json())
