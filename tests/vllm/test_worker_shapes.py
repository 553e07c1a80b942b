"""Our `both` worker answers the OpenAI surface in plain `vllm serve`'s shapes: the same keys in the same
order and, where both compute them the same way (greedy, token-id or chat prompts), the same values."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from stack.serving import Stack
from stack.vllm import SERVED_NAME
from tests.worker_process import WorkerProcess

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")

IDS = [256, 72, 101, 108, 108, 111, 32, 195, 169]   # <|bos|>Hello é (the last character in two tokens)
# Its greedy answer ends in a whole character (vLLM drops a trailing partial one, we show U+FFFD).
CHAT = [{"role": "user", "content": "def add(a, b):"}]
GREEDY = {"model": SERVED_NAME, "temperature": 0}
SAMPLED = {"model": SERVED_NAME, "temperature": 1.0, "seed": 5}   # our sampler's draws are not vLLM's: keys only
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
CASES = {   # name: (endpoint, body, compare values)
    "logprobs": ("completions", {**GREEDY, "prompt": IDS, "max_tokens": 5, "logprobs": 2}, True),
    "logprobs-streamed": ("completions", {**GREEDY, "prompt": IDS, "max_tokens": 5, "logprobs": 2, **STREAM}, True),
    "echo": ("completions", {**GREEDY, "prompt": IDS, "max_tokens": 3, "echo": True, "logprobs": 1}, True),
    "echo-max-tokens-0": ("completions", {**GREEDY, "prompt": IDS, "max_tokens": 0, "echo": True, "logprobs": 1,
                                          **STREAM}, True),
    "prompt-logprobs": ("completions", {**GREEDY, "prompt": IDS, "max_tokens": 2, "prompt_logprobs": 2}, True),
    "penalties-bias-min-tokens": ("completions", {
        **GREEDY, "prompt": IDS, "max_tokens": 10, "presence_penalty": 0.5, "frequency_penalty": 0.3,
        "repetition_penalty": 1.3, "logit_bias": {"65": 4}, "min_tokens": 4, "stop_token_ids": [34, 32]}, True),
    "list-n": ("completions", {**SAMPLED, "prompt": [IDS, IDS[:4]], "n": 2, "max_tokens": 3}, False),
    "list-n-streamed": ("completions", {**SAMPLED, "prompt": [IDS, IDS[:4]], "n": 2, "max_tokens": 3, **STREAM},
                        False),
    "chat-logprobs": ("chat/completions", {**GREEDY, "messages": CHAT, "max_tokens": 4, "logprobs": True,
                                           "top_logprobs": 2}, True),
    "chat-logprobs-streamed": ("chat/completions", {**GREEDY, "messages": CHAT, "max_tokens": 4, "logprobs": True,
                                                    "top_logprobs": 2, **STREAM}, True),
    "chat-prompt-logprobs": ("chat/completions", {**GREEDY, "messages": CHAT, "max_tokens": 4,
                                                  "prompt_logprobs": 1}, True),
    "chat-n-streamed": ("chat/completions", {**SAMPLED, "messages": CHAT, "n": 2, "max_tokens": 2,
                                             "stream": True}, False),
}
ERRORS = {   # name: (endpoint, body); both refuse it naming the same parameter
    "logprobs-over-20": ("completions", {**GREEDY, "prompt": IDS, "logprobs": 21}),
    "logit-bias-key": ("completions", {**GREEDY, "prompt": IDS, "logit_bias": {"a": 1}}),
    "stop-token-out-of-vocab": ("completions", {**GREEDY, "prompt": IDS, "stop_token_ids": [99999]}),
    "streamed-prompt-logprobs": ("completions", {**GREEDY, "prompt": IDS, "prompt_logprobs": 1, "stream": True}),
    "top-logprobs-alone": ("chat/completions", {**GREEDY, "messages": CHAT, "top_logprobs": 2}),
    "chat-max-tokens-0": ("chat/completions", {**GREEDY, "messages": CHAT, "max_tokens": 0}),
}
VOLATILE = {"id", "created", "system_fingerprint"}


@pytest.fixture(scope="module")
def ours() -> Iterator[WorkerProcess]:
    worker = WorkerProcess("both", extra=["--served-model-name", SERVED_NAME, "--max-model-len", "1280"])
    try:
        yield worker
    finally:
        worker.stop()


def reply(url: str, endpoint: str, request: dict[str, Any]) -> Any:
    response = httpx.post(f"{url}/v1/{endpoint}", json=request, timeout=60.0)
    if response.status_code != 200 or not request.get("stream"):
        return response.status_code, response.json()
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return response.status_code, [json.loads(line) for line in lines[:-1]] + [lines[-1]]


def same(got: Any, want: Any, values: bool, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        assert [k for k in got if k not in VOLATILE] == [k for k in want if k not in VOLATILE], where
        for key in set(want) - VOLATILE:
            same(got[key], want[key], values, f"{where}.{key}")
    elif isinstance(want, list) and (values or all(isinstance(w, (dict, list)) for w in want)):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, values, f"{where}[{i}]")
    elif values and isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-3), where
    elif values:
        assert got == want, where


@pytest.mark.parametrize("case", CASES)
def test_our_worker_answers_in_vllms_shape(reference: Stack, ours: WorkerProcess, case: str) -> None:
    endpoint, request, values = CASES[case]
    (status, got), (want_status, want) = reply(ours.url, endpoint, request), reply(reference.url, endpoint, request)
    assert status == want_status == 200
    if isinstance(want, list) and not values:   # stream chunks of several choices interleave differently
        got, want = sorted(got[:-1], key=_index) + got[-1:], sorted(want[:-1], key=_index) + want[-1:]
    same(got, want, values)


def _index(chunk: dict[str, Any]) -> int:
    return chunk["choices"][0]["index"] if chunk["choices"] else 1 << 30


@pytest.mark.parametrize("case", ERRORS)
def test_what_vllm_refuses_we_refuse_naming_the_same_parameter(reference: Stack, ours: WorkerProcess,
                                                               case: str) -> None:
    endpoint, request = ERRORS[case]
    (status, got), (want_status, want) = reply(ours.url, endpoint, request), reply(reference.url, endpoint, request)
    assert status == want_status == 400
    assert got["error"]["param"] == want["error"]["param"]
