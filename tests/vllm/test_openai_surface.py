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
from tests.surface import (C, JSON_SCHEMA, PREFILL_ALONE, PROMPTS, SHAPES, assert_shape_equal, differences,
                           seen_stream, seen_whole)
from tests.vllm.client import limited, metric
from tests.vllm.test_parity import kv_usage_back_to_zero

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")


# Seconds of the default suite: the shapes whose paths a default one takes (fan-out, the seam, the prefill
# worker alone; JSON schema: the concurrency test below) run with --full.
FAST_SHAPES = ("logprobs", "chat-n", "prompt-list", "echo-max-tokens-0", "sampling", "usage",
               "stop-strings")


@pytest.mark.parametrize("shape", [s if s in FAST_SHAPES else pytest.param(s, marks=pytest.mark.slow)
                                   for s in SHAPES])
def test_shape_equals_one_vllm_server(reference: Stack, neuron_stack: Stack, shape: str) -> None:
    decode = neuron_stack.worker_urls["decode"]
    decode_requests = metric(decode, "vllm:request_success_total")
    with httpx.Client(timeout=120) as client:
        largest = assert_shape_equal(client, SERVED_NAME, reference.url, neuron_stack.url, shape)
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
    """A whole answer's choice or a stream's assembled one (see tests/surface.py)."""
    if "finish" in choice:
        return choice["text"], choice["finish"][0][0]
    return choice["text"], choice["finish_reason"]
