"""Every request shape one `vllm serve` answers, answered the same through our proxy over vLLM 1P1D with
NeuronConnector: logprobs, n, lists of prompts, echo and prompt logprobs, structured output, sampling
parameters, usage; greedy and seeded, streamed and not; KV back to 0 after each."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from examples.serving_stack import Stack
from examples.vllm_stack import SERVED_NAME
from tests.vllm.client import limited, metric
from tests.vllm.surface import ask, differences, seen_stream, seen_whole
from tests.vllm.test_parity import kv_usage_back_to_zero

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")

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
}
PREFILL_ALONE = ("echo-max-tokens-0", "echo", "prompt-logprobs")  # no decode leg, no KV moved
GREEDY_REFUSED = ("n", "chat-n", "token-id-lists")  # n > 1 greedy: a 400 from one server, and so from the proxy


def shape_body(endpoint: str, extra: dict[str, Any], sampling: dict[str, Any], stream: bool) -> dict[str, Any]:
    key = {"messages": [{"role": "user", "content": PROMPTS[0]}]} if endpoint == H else {"prompt": PROMPTS[0]}
    body = {"model": SERVED_NAME, **key, "max_tokens": 8, **sampling, **extra, "stream": stream}
    if stream:
        body["stream_options"] = extra.get("stream_options", {"include_usage": True})
    else:
        body.pop("stream_options", None)
    return body


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_equals_one_vllm_server(reference: Stack, neuron_stack: Stack, shape: str) -> None:
    endpoint, extra = SHAPES[shape]
    decode = neuron_stack.worker_urls["decode"]
    decode_requests = metric(decode, "vllm:request_success_total")
    largest = 0.0
    with httpx.Client(timeout=120) as client:
        for sampling in (GREEDY, SEEDED):
            for stream in (False, True):
                body = shape_body(endpoint, extra, sampling, stream)
                want = ask(client, reference.url, endpoint, body)
                got = ask(client, neuron_stack.url, endpoint, body)
                found, diff = differences(got, want)
                assert not found, f"{sampling} stream={stream}: {found[:5]}"
                assert "status" not in want or (sampling is GREEDY and shape in GREEDY_REFUSED), want
                largest = max(largest, diff)
    kv_usage_back_to_zero(neuron_stack)
    if shape in PREFILL_ALONE:
        assert metric(decode, "vllm:request_success_total") == decode_requests
    print(f"{shape}: largest logprob difference {largest:.2e}")


def load_bodies(count: int) -> list[dict[str, Any]]:
    """Three prompts, three choices each, constrained to a JSON schema, seeded; every other one streamed."""
    return [{"model": SERVED_NAME, "prompt": PROMPTS[i % 3:] + PROMPTS[:i % 3], "n": 3, "max_tokens": 24,
             "temperature": 0.8, "seed": i, "stream": i % 2 == 1, **JSON_SCHEMA,
             **({"stream_options": {"include_usage": True}} if i % 2 else {})} for i in range(count)]


async def _answers(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any] | str]:
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(body: dict[str, Any]) -> dict[str, Any] | str:
            if not body["stream"]:
                reply = await client.post(url + C, json=body)
                return seen_whole(reply.json()) if reply.status_code == 200 else reply.text
            async with client.stream("POST", url + C, json=body) as reply:
                raw = (await reply.aread()).decode()
            return seen_stream(raw) if reply.status_code == 200 else raw
        return await limited(concurrency, [one(b) for b in bodies])


def test_prompt_lists_n3_json_schema_at_concurrency_8(reference: Stack, neuron_stack: Stack) -> None:
    bodies = load_bodies(8)
    want = asyncio.run(_answers(reference.url, bodies, 1))
    got = asyncio.run(_answers(neuron_stack.url, bodies, 8))
    failures = [g for g in got if isinstance(g, str)]
    assert not failures, failures[:2]
    mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if differences(g, w)[0]]
    assert not mismatched, f"requests {mismatched} differ: {differences(got[mismatched[0]], want[mismatched[0]])[0][:5]}"
    answers = [_text_and_finish(choice) for w in want for choice in _choices(w)]
    assert len(answers) == 8 * 9
    ended = [json.loads(text) for text, finish in answers if finish == "stop"]  # the schema's object is complete
    assert all(set(obj) == {"color", "size"} and obj["color"] in ("red", "green", "blue") for obj in ended)
    kv_usage_back_to_zero(neuron_stack)
    assert metric(neuron_stack.url, "proxy_first_token_mismatches_total") == 0


def _choices(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return list(answer["choices"].values()) if isinstance(answer["choices"], dict) else answer["choices"]


def _text_and_finish(choice: dict[str, Any]) -> tuple[str, str]:
    """A whole answer's choice or a stream's assembled one (see tests/vllm/surface.py)."""
    if "finish" in choice:
        return choice["text"], choice["finish"][0][0]
    return choice["text"], choice["finish_reason"]
