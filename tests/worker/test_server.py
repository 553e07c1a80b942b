"""The worker's OpenAI server over real HTTP: one worker subprocess on the built-in model, shared by the module."""
from __future__ import annotations

import asyncio
import json
import re
import socket
from typing import Iterator

import httpx
import openai
import pytest

from stack.worker_metrics import metric
from tests.helpers import wait_until
from tests.worker_process import WorkerProcess
from worker.model.loader import builtin_model_path

GREEDY = {"temperature": 0.0}
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    proc = WorkerProcess(extra=["--max-waiting", "64"])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def model(worker: WorkerProcess) -> dict:
    return httpx.get(f"{worker.url}/v1/models").json()["data"][0]


@pytest.fixture
def client(worker: WorkerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def all_blocks_free(url: str) -> bool:
    return (metric(url, "neuron_di_kv_blocks_used") == 0 and metric(url, "neuron_di_requests_running") == 0
            and metric(url, "neuron_di_requests_waiting") == 0)


def test_completion_streamed_text_equals_one_shot_text(client: openai.OpenAI, model: dict) -> None:
    kwargs = dict(model=model["id"], prompt="The capital of France is", max_tokens=12, **GREEDY,
                  extra_body=LONG)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert len(chunks) == 12   # one chunk per token, even one whose text is held back


def test_chat_streamed_text_equals_one_shot_text_with_usage(client: openai.OpenAI, model: dict) -> None:
    kwargs = dict(model=model["id"], messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Name a color."}],
                  max_completion_tokens=10, **GREEDY, extra_body=LONG)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    usage_chunk, text_chunks = chunks[-1], chunks[:-1]
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.usage is None for c in text_chunks)
    assert text_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == whole.choices[0].message.content
    assert text_chunks[-1].choices[0].finish_reason == "length"


def test_token_id_prompt_is_accepted_and_deterministic(worker: WorkerProcess) -> None:
    body = {"prompt": [5, 17, 42, 99, 7], "max_tokens": 6, **GREEDY, **LONG}
    first, second = (httpx.post(f"{worker.url}/v1/completions", json=body).json() for _ in range(2))
    assert first["usage"] == {"prompt_tokens": 5, "total_tokens": 11, "completion_tokens": 6,
                              "prompt_tokens_details": None, "completion_tokens_details": None}   # vLLM's shape
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, model: dict) -> None:
    kwargs = dict(model=model["id"], prompt="One, two, three,", max_tokens=16, **GREEDY, extra_body=LONG)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # any two characters of the greedy text
    assert len(stop) == 2, text
    stopped = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]


def test_request_id_header_is_used_and_echoed(worker: WorkerProcess) -> None:
    r = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-42" and r.json()["id"] == "cmpl-req-42"
    r = httpx.post(f"{worker.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2, "stream": True}, headers={"X-Request-Id": "req-43"})
    assert r.headers["x-request-id"] == "req-43" and '"id":"chatcmpl-req-43"' in r.text
    r = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"


def test_models_lists_the_served_model(worker: WorkerProcess, client: openai.OpenAI, model: dict) -> None:
    assert [m.id for m in client.models.list().data] == [model["id"]]
    assert model["object"] == "model" and model["max_model_len"] > 0


def test_the_dtype_and_hidden_size_image_embeddings_need_are_shown_and_agree_with_the_config(
        worker: WorkerProcess, model: dict) -> None:
    config = json.loads((builtin_model_path() / "config.json").read_text())
    assert (model["dtype"], model["hidden_size"]) == (config["torch_dtype"], config["hidden_size"]) == ("float32", 256)
    assert httpx.get(f"{worker.url}/health").json()["worker"]["dtype"] == "float32"


def test_metrics_has_the_named_series(worker: WorkerProcess) -> None:
    httpx.post(f"{worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, **LONG})
    text = httpx.get(f"{worker.url}/metrics").text
    for name in ("neuron_di_requests_running", "neuron_di_requests_waiting", "neuron_di_kv_blocks_used",
                 "neuron_di_kv_blocks_total", "neuron_di_generation_tokens_total", "neuron_di_prompt_tokens_total",
                 "neuron_di_ttft_seconds_bucket", "neuron_di_itl_seconds_bucket", "neuron_di_requests_total"):
        assert f"\n{name}" in text, name
    assert metric(worker.url, "neuron_di_kv_blocks_total") > 0
    assert metric(worker.url, "neuron_di_requests_total", outcome="length") >= 1


def test_health(worker: WorkerProcess) -> None:
    r = httpx.get(f"{worker.url}/health")
    engine_id = r.json()["worker"]["engine_id"]   # unique per process: hostname:port:random
    assert re.fullmatch(rf"{re.escape(socket.gethostname())}:{worker.port}:[0-9a-f]{{8}}", engine_id), engine_id
    # `worker`: the record it would register in etcd
    assert (r.status_code, r.json()) == (200, {"status": "ok", "draining": False, "worker": {
        "role": "both", "host": "127.0.0.1", "http_port": worker.port, "kv_host": "127.0.0.1", "kv_port": 0,
        "engine_id": engine_id, "model": "neuron-di-builtin", "transfer": {"backend": "auto"},
        "kv_protocol": "neuron", "status_port": 0, "server": "neuron-di", "kv_secret_id": "", "dtype": "float32",
        "kv_events": ""}})


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(worker: WorkerProcess, model: dict) -> None:
    # Long enough that finishing naturally would take far longer than the deadline below.
    body = {"prompt": "Tell me a long story.", "max_tokens": model["max_model_len"] - 64, "stream": True, **LONG}
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(worker.url, "neuron_di_kv_blocks_used") > 0
    # The connection is closed after one chunk; the server must abort the sequence and free its blocks.
    wait_until(lambda: all_blocks_free(worker.url), timeout=30, what="blocks freed after disconnect")
    assert metric(worker.url, "neuron_di_requests_total", outcome="disconnect") >= 1


def test_duplicate_in_flight_request_id_is_rejected(worker: WorkerProcess, model: dict) -> None:
    body = {"prompt": "A", "max_tokens": model["max_model_len"] // 2, "stream": True, **LONG}
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, headers={"X-Request-Id": "dup"},
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: dropping the iterator closes the connection
        assert next(lines).startswith("data: ")
        second = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "B", "max_tokens": 2},
                            headers={"X-Request-Id": "dup"})
    assert second.status_code == 400
    assert second.json() == {"error": {"message": "request id 'dup' is already in use",
                                       "type": "invalid_request_error", "param": None, "code": 400}}
    wait_until(lambda: all_blocks_free(worker.url), timeout=30, what="blocks freed")


def test_32_concurrent_requests_complete_and_free_every_block(worker: WorkerProcess) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"prompt": f"Request number {i} says", "max_tokens": 8, "stream": i % 2 == 0, **LONG}
        return await client.post(f"{worker.url}/v1/completions", json=body)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=240) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 32
    for i, r in enumerate(responses):
        if i % 2:
            assert r.json()["usage"]["completion_tokens"] == 8
        else:
            assert r.text.endswith("data: [DONE]\n\n") and r.text.count('"finish_reason":"length"') == 1
    wait_until(lambda: all_blocks_free(worker.url), timeout=30, what="every block free")


def error(message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": 400}}


BAD_REQUESTS = [
    ("completions", b"{not json", None, "request body is not valid JSON"),
    ("completions", b"[1, 2]", None, "request body must be a JSON object"),
    ("completions", {"max_tokens": 3}, "prompt", "`prompt` must be a string, a non-empty list of token ids"),
    ("completions", {"prompt": 7}, "prompt", "`prompt` must be a string, a non-empty list of token ids"),
    ("completions", {"prompt": ["a", 3]}, "prompt", "`prompt` must be a string, a non-empty list of token ids"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "`max_tokens` must be of type integer"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature", "`temperature` must be of type number"),
    ("completions", {"prompt": "hi", "stop": 3}, "stop", "`stop` must be a string or a list of strings"),
    ("completions", {"prompt": "hi", "n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling"),
    ("completions", {"prompt": "hi", "seed": 2**100}, "seed", "seed must be an int in [-2**63, 2**63)"),
    ("completions", b"[" * 100_000 + b"]" * 100_000, None, "request body is nested more than 64 levels deep"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of", "`best_of` is not supported by this server"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3},
     "presence_penalty", "presence_penalty must be a number in [-2, 2], got 3.0"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"grammar": "x"}},
     "structured_outputs", "`structured_outputs.grammar` is not supported by this server"),
    ("completions", {"prompt": "hi", "model": "gpt-17"}, "model", "The model `gpt-17` does not exist."),
    ("completions", {"prompt": [1, -4]}, None, "prompt token ids must be ints in [0, "),
    ("chat/completions", {"messages": []}, "messages", "`messages` must be a non-empty list"),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages[0]", "messages[0] must be an object"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens", "max_completion_tokens must be at least 1, got -1"),
]


@pytest.mark.parametrize("path,body,param,message", BAD_REQUESTS)
def test_bad_request_is_400_then_the_server_still_serves(worker: WorkerProcess, path: str, body: object,
                                                         param: str | None, message: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{worker.url}/v1/{path}", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    got = r.json()
    assert got["error"]["message"].startswith(message)
    assert got == error(got["error"]["message"], param)
    good = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_prompt_longer_than_the_context_is_400(worker: WorkerProcess, model: dict) -> None:
    n = model["max_model_len"]
    # The same words whatever max_tokens says: a disaggregated request's prefill leg asks for 1 token.
    for max_tokens in (1, 16):
        r = httpx.post(f"{worker.url}/v1/completions", json={"prompt": [5] * (n + 1), "max_tokens": max_tokens})
        assert r.status_code == 400
        assert r.json() == error(f"This model's maximum context length is {n} tokens. However, the prompt has "
                                 f"{n + 1} tokens, which leaves no room for a completion. Please reduce the prompt.",
                                 "prompt")
    r = httpx.post(f"{worker.url}/v1/completions", json={"prompt": [5] * 4, "max_tokens": n})
    assert r.status_code == 400 and r.json() == error(
        f"This model's maximum context length is {n} tokens. However, you requested {n + 4} tokens (4 in the "
        f"prompt, {n} in the completion). Please reduce the prompt or max_tokens.", "prompt")


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_megabytes_of_prompt_text_are_refused_before_tokenizing(worker: WorkerProcess, model: dict,
                                                                path: str) -> None:
    n, text = model["max_model_len"], "x" * 3_000_000  # tokenizing it would take the server seconds
    body = {"prompt": text} if path == "completions" else {"messages": [{"role": "user", "content": text}]}
    r = httpx.post(f"{worker.url}/v1/{path}", json={**body, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400
    got = r.json()["error"]
    assert got["param"] == ("prompt" if path == "completions" else "messages")
    assert got["message"].startswith(f"This model's maximum context length is {n} tokens. However, the prompt "
                                     f"has "), got
    assert re.search(r"has (\d+) characters, at least (\d+) tokens\. Please reduce the prompt\.$", got["message"])
    short = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "x" * (n - 2), "max_tokens": 1}, timeout=60)
    assert short.status_code == 200  # a text that fits is still tokenized and served


def test_unknown_route_and_wrong_method(worker: WorkerProcess) -> None:
    r = httpx.get(f"{worker.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{worker.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_openai_client_raises_typed_errors_from_the_error_body(client: openai.OpenAI, model: dict) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model["id"], prompt="hi", max_tokens=0)
    assert info.value.status_code == 400
    assert info.value.body == {"message": "max_tokens must be at least 1, got 0", "type": "invalid_request_error",
                               "param": "max_tokens", "code": 400}
