"""Request shapes of the OpenAI API, and what a client sees of one answer, whole or streamed, in a form two
servers' answers can be compared in: ids, creation times and server fingerprints left out, a stream
assembled per choice index.

Floats (logprobs) are compared within a tolerance: the prefill and decode servers compute them
separately from the one server they are compared with; everything else must be equal.
"""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx

LOGPROB_TOLERANCE = 1e-4
_PER_SERVER = ("id", "created", "system_fingerprint")


C, H = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["The quick brown fox jumps over the lazy dog and", "def add(a, b):\n    return", "1, 2, 3, 4,"]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "size"], "additionalProperties": False}
JSON_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}}
GREEDY, SEEDED = {"temperature": 0}, {"temperature": 0.8, "seed": 1234}
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "logprobs": (C, {"logprobs": 3}),
    "chat-top-logprobs": (H, {"logprobs": True, "top_logprobs": 3}),
    "n": (C, {"n": 3, "logprobs": 1}),
    "chat-n": (H, {"n": 2, "logprobs": True}),
    "prompt-list": (C, {"prompt": PROMPTS, "logprobs": 1}),
    "token-id-lists": (C, {"prompt": [[72, 101, 108, 108, 111], [49, 44, 32, 50, 44]], "n": 2}),
    "echo-max-tokens-0": (C, {"echo": True, "logprobs": 2, "max_tokens": 0}),   # lm-eval's loglikelihood
    "echo": (C, {"echo": True, "logprobs": 1}),
    "prompt-logprobs": (C, {"prompt_logprobs": 2}),
    "json-schema": (H, JSON_SCHEMA),
    "sampling": (C, {"stop_token_ids": [10], "min_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                     "repetition_penalty": 1.3, "logit_bias": {"32": -100}}),
    "usage": (H, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "stop-strings": (C, {"stop": [" a", "e "], "logprobs": 1}),   # greedy: the stop string starts at token one
    "best-of": (C, {"best_of": 2}),
}
PREFILL_ALONE = ("echo-max-tokens-0", "echo", "prompt-logprobs")  # no decode leg, no KV moved
GREEDY_REFUSED = ("n", "chat-n", "token-id-lists")  # n > 1 greedy: a 400 from one server, and so from the proxy
STREAM_REFUSED = ("prompt-logprobs",)  # vLLM's rule: prompt logprobs are not streamed


def shape_body(model: str, endpoint: str, extra: dict[str, Any], sampling: dict[str, Any],
               stream: bool) -> dict[str, Any]:
    key = {"messages": [{"role": "user", "content": PROMPTS[0]}]} if endpoint == H else {"prompt": PROMPTS[0]}
    body = {"model": model, **key, "max_tokens": 8, **sampling, **extra, "stream": stream}
    if stream:
        body["stream_options"] = extra.get("stream_options", {"include_usage": True})
    else:
        body.pop("stream_options", None)
    return body


def ask(client: httpx.Client, url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer to `body`, as seen_whole() or seen_stream() see it; an error as its status alone (the
    proxy's wording may differ from the worker's)."""
    if not body.get("stream"):
        reply = client.post(url + endpoint, json=body)
        return seen_whole(reply.json()) if reply.status_code == 200 else {"status": reply.status_code}
    with client.stream("POST", url + endpoint, json=body) as reply:
        raw = reply.read().decode()
    return seen_stream(raw) if reply.status_code == 200 else {"status": reply.status_code}


def assert_shape_equal(client: httpx.Client, model: str, single: str, proxy: str, shape: str,
                       refused: tuple[str, ...] = ()) -> float:
    """`shape` greedy and seeded, streamed and not, through `proxy` equals what `single` answers (the shapes in
    `refused`, n > 1 greedy and streamed prompt logprobs: the same error status); the largest logprob
    difference."""
    endpoint, extra = SHAPES[shape]
    largest = 0.0
    for sampling in (GREEDY, SEEDED):
        for stream in (False, True):
            body = shape_body(model, endpoint, extra, sampling, stream)
            want, got = ask(client, single, endpoint, body), ask(client, proxy, endpoint, body)
            found, diff = differences(got, want)
            assert not found, f"{shape} {sampling} stream={stream}: {found[:5]}"
            assert ("status" in want) == (shape in refused or (sampling is GREEDY and shape in GREEDY_REFUSED)
                                          or (stream and shape in STREAM_REFUSED)), want
            largest = max(largest, diff)
    return largest


def seen_whole(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in _PER_SERVER}


def seen_stream(raw: str) -> dict[str, Any]:
    """A stream's choices assembled by index (text, logprobs, token ids, finish), its usage chunks and the
    running usage of its chunks (null fields left out), checked to be one answer: one id, one `created`,
    one finish per choice, one [DONE] at the end."""
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            _add(choices.setdefault(choice["index"], {"text": "", "finish": [], "usage": []}), choice, chunk)
    final = [_no_nulls(c["usage"]) for c in chunks if not c["choices"] and c.get("usage")]
    return {"choices": dict(sorted(choices.items())), "usage": final,
            "model": {c["model"] for c in chunks}, "object": {c["object"] for c in chunks}}


def _add(into: dict[str, Any], choice: dict[str, Any], chunk: dict[str, Any]) -> None:
    delta = choice.get("delta")
    into["text"] += (delta.get("content") or "") if delta is not None else (choice.get("text") or "")
    if delta and delta.get("role"):
        into["role"] = delta["role"]
    if choice.get("finish_reason"):
        into["finish"].append((choice["finish_reason"], choice.get("stop_reason")))
    if chunk.get("usage"):
        into["usage"].append(_no_nulls(chunk["usage"]))
    for key in ("token_ids", "prompt_token_ids"):
        if choice.get(key):
            into[key] = into.get(key, []) + choice[key]
    logprobs = choice.get("logprobs")
    if logprobs:
        mine = into.setdefault("logprobs", {})
        for key, value in logprobs.items():
            if isinstance(value, list):
                mine[key] = mine.get(key, []) + value


def _no_nulls(usage: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in usage.items() if v is not None}


def differences(got: Any, want: Any, where: str = "") -> tuple[list[str], float]:
    """Where `got` differs from `want` (floats beyond LOGPROB_TOLERANCE), and the largest float difference."""
    if isinstance(want, float) or isinstance(got, float):
        if not isinstance(got, (int, float)) or not isinstance(want, (int, float)):
            return [f"{where}: {got!r} != {want!r}"], 0.0
        diff = abs(got - want) if math.isfinite(got) and math.isfinite(want) else (0.0 if got == want else math.inf)
        return ([f"{where}: {got} != {want}"] if diff > LOGPROB_TOLERANCE else []), diff
    if isinstance(want, dict) and isinstance(got, dict):
        found, largest = [], 0.0
        if set(got) != set(want):
            found.append(f"{where}: keys {sorted(map(str, got))} != {sorted(map(str, want))}")
        for key in set(got) & set(want):
            more, diff = differences(got[key], want[key], f"{where}.{key}")
            found += more
            largest = max(largest, diff)
        return found, largest
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        found, largest = [], 0.0
        for i, (g, w) in enumerate(zip(got, want)):
            more, diff = differences(g, w, f"{where}[{i}]")
            found += more
            largest = max(largest, diff)
        return found, largest
    return ([] if got == want else [f"{where}: {got!r} != {want!r}"]), 0.0


def load_bodies(model: str, count: int) -> list[dict[str, Any]]:
    """Three prompts, three choices each, constrained to a JSON schema, seeded; every other one streamed."""
    return [{"model": model, "prompt": PROMPTS[i % 3:] + PROMPTS[:i % 3], "n": 3, "max_tokens": 24,
             "temperature": 0.8, "seed": i, "stream": i % 2 == 1, **JSON_SCHEMA,
             **({"stream_options": {"include_usage": True}} if i % 2 else {})} for i in range(count)]


def assert_load_equal(model: str, single: str, proxy: str, count: int = 8, concurrency: int = 8) -> None:
    """load_bodies() through `proxy`, `concurrency` at a time, every one answered (no failure) exactly as
    `single` answers them one at a time; every complete answer is an object of the schema."""
    bodies = load_bodies(model, count)
    want, got = asyncio.run(_answers(single, bodies, 1)), asyncio.run(_answers(proxy, bodies, concurrency))
    failures = [g for g in got + want if isinstance(g, str)]
    assert not failures, failures[:2]
    mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if differences(g, w)[0]]
    assert not mismatched, f"requests {mismatched} differ: {differences(got[mismatched[0]], want[mismatched[0]])[0][:5]}"
    answers = [_text_and_finish(choice) for w in want for choice in _choices(w)]
    assert len(answers) == count * 9
    ended = [json.loads(text) for text, finish in answers if finish == "stop"]  # the schema's object is complete
    assert all(set(obj) == {"color", "size"} and obj["color"] in ("red", "green", "blue") for obj in ended)


async def _answers(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any] | str]:
    """Each body's answer as seen_whole() / seen_stream() see it, or the error body of a failed one."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(body: dict[str, Any]) -> dict[str, Any] | str:
            async with gate:
                if not body["stream"]:
                    reply = await client.post(url + C, json=body)
                    return seen_whole(reply.json()) if reply.status_code == 200 else reply.text
                async with client.stream("POST", url + C, json=body) as reply:
                    raw = (await reply.aread()).decode()
                return seen_stream(raw) if reply.status_code == 200 else raw
        return list(await asyncio.gather(*(one(b) for b in bodies)))


def _choices(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return list(answer["choices"].values()) if isinstance(answer["choices"], dict) else answer["choices"]


def _text_and_finish(choice: dict[str, Any]) -> tuple[str, str]:
    """A whole answer's choice or a stream's assembled one."""
    if "finish" in choice:
        return choice["text"], choice["finish"][0][0]
    return choice["text"], choice["finish_reason"]
