"""One OpenAI request, streamed or not, reduced to what the client sees: text, finish reason, usage."""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Sequence

import httpx

from stack.vllm import SERVED_NAME


@dataclass(frozen=True, slots=True)
class Seen:
    text: str
    finish_reason: str
    completion_tokens: int


def body(endpoint: str, prompt: Any, max_tokens: int, stream: bool, **sampling: Any) -> dict[str, Any]:
    key = {"messages": [{"role": "user", "content": prompt}]} if endpoint.endswith("chat/completions") \
        else {"prompt": prompt}
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    return {"model": SERVED_NAME, **key, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            **extra, **sampling}


async def request(client: httpx.AsyncClient, url: str, endpoint: str, payload: dict[str, Any]) -> Seen:
    if not payload.get("stream"):
        response = await client.post(url + endpoint, json=payload)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return Seen(text, choice["finish_reason"], data["usage"]["completion_tokens"])
    parts, finish, usage = [], [], None
    async with client.stream("POST", url + endpoint, json=payload) as response:
        assert response.status_code == 200, await response.aread()
        raw = (await response.aread()).decode()
    events = [e for e in re.split(r"\n\n", raw) if e.strip()]
    assert events[-1] == "data: [DONE]", events[-3:]
    for event in events[:-1]:
        chunk = json.loads(event.removeprefix("data: "))
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if choice.get("finish_reason"):
                finish.append(choice["finish_reason"])
    assert len(finish) == 1, finish
    return Seen("".join(parts), finish[0], usage["completion_tokens"])


async def limited(concurrency: int, coros: Sequence[Awaitable[Any]]) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def run(coro: Awaitable[Any]) -> Any:
        async with gate:
            return await coro
    return list(await asyncio.gather(*(run(c) for c in coros)))


async def answers(url: str, endpoint: str, payloads: list[dict[str, Any]], concurrency: int) -> list[Seen]:
    async with httpx.AsyncClient(timeout=300.0) as client:
        return await limited(concurrency, [request(client, url, endpoint, p) for p in payloads])
