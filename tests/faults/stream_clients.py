"""Streamed answers as a client reads them, and the same requests asked of one `both` worker."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Streamed:
    """What one client read from one stream: its text, end, usage and the time between its events."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    events: int = 0
    errors: list[Any] = field(default_factory=list)
    largest_gap: float = 0.0

    @property
    def moves(self) -> int:
        return int((self.usage or {}).get("stream_moves", 0))


def bodies(model: str, count: int, max_tokens: int, chat_every: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """`count` requests (path, body): half greedy, half sampled with a seed; every `chat_every`-th a chat one."""
    out = []
    for i in range(count):
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
        common = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, **sampling}
        if chat_every and i % chat_every == chat_every - 1:
            out.append(("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": f"Tell story number {i} about a cat."}], **common}))
        else:
            out.append(("/v1/completions", {"prompt": f"Once upon a time, story {i} began with", **common}))
    return out


async def stream(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], progress: list[int],
                 index: int) -> Streamed:
    """Reads one streamed answer; `progress[index]` counts its events as they come."""
    got = Streamed()
    last = time.perf_counter()
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + path, json=request) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            got.largest_gap, last = max(got.largest_gap, now - last), now
            chunk = json.loads(line[6:])
            if "error" in chunk:
                got.errors.append(chunk["error"])
                continue
            if chunk.get("usage") and not chunk.get("choices"):
                got.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                got.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                got.finish_reason = choice.get("finish_reason") or got.finish_reason
            got.events += 1
            progress[index] = got.events
    return got


async def whole(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> Streamed:
    """The same request, not streamed, as one `both` worker answers it."""
    reply = await client.post(url + path, json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    choice = answer["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return Streamed(text, choice["finish_reason"], answer["usage"])


async def run_streams(url: str, requests: list[tuple[str, dict[str, Any]]], progress: list[int]) -> list[Streamed]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        return await asyncio.gather(*(stream(client, url, path, body, progress, i)
                                      for i, (path, body) in enumerate(requests)))


async def reference(url: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Streamed]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        return list(await asyncio.gather(*(whole(client, url, path, body) for path, body in requests)))
