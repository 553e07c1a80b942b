"""What a client gets from a worker or the proxy: the text, finish reason and usage of one answer,
streamed or not, with the stream's shape checked on the way (one [DONE], at the end, no error event)."""
from __future__ import annotations

import json
import re
from typing import Any

import httpx

MODEL = "neuron-di-builtin"
PROMPT = "def fibonacci(n):\n    "
MESSAGES = [{"role": "user", "content": "Write a for loop over a list."}]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.8, "top_k": 8, "seed": 1234}  # top_k: ASCII code, no UTF-8 split at token one


def request_body(chat: bool, stream: bool, sampling: dict[str, Any], max_tokens: int = 12,
                 prompt: str = PROMPT) -> tuple[str, dict[str, Any]]:
    """(path, body) of a completion or chat request."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream, **sampling}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        return "/v1/chat/completions", {**body, "messages": MESSAGES if prompt == PROMPT else
                                        [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def answer(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of one answer; fails the test on any error."""
    reply = await client.post(f"{url}{path}", json=body)
    assert reply.status_code == 200, reply.text
    if not body["stream"]:
        choice = reply.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, choice["finish_reason"], _counts(reply.json()["usage"])
    payloads = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1, payloads[-3:]
    text, finish, usage = "", "", {}
    for chunk in map(json.loads, payloads[:-1]):
        assert "error" not in chunk, chunk
        usage = _counts(chunk["usage"]) if chunk.get("usage") else usage
        for choice in chunk["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish, usage


def _counts(usage: dict[str, Any]) -> dict[str, int]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}


def paths(proxy: Any) -> dict[str, int]:
    """The proxy's requests by path (conditional disaggregation: "local", "remote") so far."""
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    return {path: int(float(n)) for path, n in re.findall(r'^proxy_request_paths_total\{path="(\w+)"\} (\S+)$',
                                                          metrics, re.M)}
