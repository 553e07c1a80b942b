"""The official OpenAI client through proxy_server.py to a real prefill + decode pair.

Every answer must equal the one a single worker of role `both` gives to the same request.
"""
from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator, Sequence

import httpx
import openai
import pytest

from stack.worker_metrics import metric, metric_sum
from tests.di.workers import worker_pair
from tests.helpers import wait_until
from tests.lm_eval_check import assert_same_scores, evaluate
from tests.surface import PREFILL_ALONE, SHAPES, assert_load_equal, assert_shape_equal
from tests.timeline_checks import assert_phases_add_up, request_timeline, uid_of
from tests.worker_process import WorkerProcess
from tests.proxy.conftest import Server, proxied_1p1d, start_proxy

PROMPT = "def fibonacci(n):\n    "
MESSAGES = [{"role": "user", "content": "Write a for loop over a list."}]
SAMPLING = {"max_tokens": 12, "temperature": 0.0}
BUSY = 4  # requests keeping a decode engine busy


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Server, WorkerProcess, WorkerProcess, WorkerProcess]]:
    with proxied_1p1d() as started:
        yield started


@pytest.fixture(autouse=True)
def blocks_free_after(stack: tuple[Server, WorkerProcess, WorkerProcess, WorkerProcess]) -> Iterator[None]:
    yield
    for worker in stack[1:]:
        worker.wait_blocks_free()


def clients(stack: tuple[Server, WorkerProcess, WorkerProcess, WorkerProcess]) -> tuple[openai.OpenAI, openai.OpenAI]:
    proxy, _, _, both = stack
    return (openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0),
            openai.OpenAI(base_url=f"{both.url}/v1", api_key="x", max_retries=0))


def completion(client: openai.OpenAI, stream: bool) -> tuple[str, str | None]:
    if not stream:
        choice = client.completions.create(model="neuron-di-builtin", prompt=PROMPT, **SAMPLING).choices[0]
        return choice.text, choice.finish_reason
    text, reason = "", None
    for chunk in client.completions.create(model="neuron-di-builtin", prompt=PROMPT, stream=True, **SAMPLING):
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def chat(client: openai.OpenAI, stream: bool) -> tuple[str, str | None]:
    if not stream:
        choice = client.chat.completions.create(model="neuron-di-builtin", messages=MESSAGES, **SAMPLING).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(model="neuron-di-builtin", messages=MESSAGES, stream=True,
                                                **SAMPLING):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


# The openai client's view; tests/proxy/test_flows.py covers every flow, call and stream by default.
@pytest.mark.parametrize("call, stream", [(completion, True), (chat, False),
                                          pytest.param(completion, False, marks=pytest.mark.slow),
                                          pytest.param(chat, True, marks=pytest.mark.slow)])
def test_proxy_answers_as_one_worker(stack, call, stream: bool) -> None:
    through_proxy, single = clients(stack)
    want = call(single, stream)
    assert want[0] and want[1] in ("stop", "length")
    assert call(through_proxy, stream) == want


def test_timeline_phases_add_up(stack) -> None:
    """One streamed request's phases, read back from the proxy and both workers (GET /timeline)."""
    proxy, prefill, decode, _ = stack
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
    ids = {chunk.id for chunk in client.completions.create(model="neuron-di-builtin", prompt=PROMPT, stream=True,
                                                             **SAMPLING)}
    [uid] = {uid_of(i) for i in ids}
    urls = {"proxy": proxy.url, "prefill": prefill.url, "decode": decode.url}
    path = assert_phases_add_up(request_timeline(urls, uid), streamed=True)
    assert path[-1][1] > 0
    assert "neuron_di_timeline_seconds_count{span=\"push\"}" in httpx.get(f"{prefill.url}/metrics").text


def test_proxy_usage_counts_the_whole_completion(stack) -> None:
    through_proxy, single = clients(stack)
    got = through_proxy.completions.create(model="neuron-di-builtin", prompt=PROMPT, **SAMPLING).usage
    want = single.completions.create(model="neuron-di-builtin", prompt=PROMPT, **SAMPLING).usage
    assert (got.prompt_tokens, got.completion_tokens) == (want.prompt_tokens, want.completion_tokens)


# Logprobs at the seam, several answers, the prefill worker alone, sampling parameters, a refusal; the other
# shapes take the same paths (tests/vllm/test_openai_surface.py runs every one over vLLM by default).
FAST_SHAPES = ("logprobs", "chat-n", "prompt-list", "echo-max-tokens-0", "sampling", "json-schema",
               "stop-strings")
REFUSED = ("best-of",)  # our worker does not serve best_of


@pytest.mark.parametrize("shape", [s if s in FAST_SHAPES else pytest.param(s, marks=pytest.mark.slow)
                                   for s in SHAPES])
def test_request_shape_equals_one_worker(stack, shape: str) -> None:
    """Greedy and seeded, streamed and not; what our worker refuses is its 400 either way."""
    proxy, _, decode, both = stack
    pulls = metric(decode.url, "neuron_di_kv_pulls_total")
    with httpx.Client(timeout=120) as client:
        assert_shape_equal(client, "neuron-di-builtin", both.url, proxy.url, shape, REFUSED)
    if shape in PREFILL_ALONE:  # no decode leg, no KV moved
        assert metric(decode.url, "neuron_di_kv_pulls_total") == pulls


@pytest.mark.slow  # tests/vllm/test_openai_surface.py runs it over vLLM workers by default
def test_prompt_lists_n3_json_schema_at_concurrency_8(stack) -> None:
    proxy, _, _, both = stack
    assert_load_equal("neuron-di-builtin", both.url, proxy.url)


@pytest.mark.slow  # tests/vllm/test_lm_eval.py runs it over vLLM workers by default
def test_lm_eval_scores_through_the_proxy_equal_one_worker(stack, tmp_path, monkeypatch) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[test])")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    proxy, _, _, both = stack
    assert_same_scores(evaluate(proxy.url, "neuron-di-builtin", tmp_path),
                       evaluate(both.url, "neuron-di-builtin", tmp_path), tolerance=1e-3)


@pytest.mark.slow  # tests/proxy/test_flows.py sends 16 at once in every flow by default
def test_sixteen_concurrent_requests_through_the_proxy(stack) -> None:
    proxy, _, _, both = stack
    prompts = [f"class Thing{i}:\n    def " for i in range(16)]

    async def run(url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        try:
            answers = await asyncio.gather(*(client.completions.create(
                model="neuron-di-builtin", prompt=p, **SAMPLING) for p in prompts))
        finally:
            await client.close()
        return [a.choices[0].text for a in answers]
    assert asyncio.run(run(proxy.url)) == asyncio.run(run(both.url))


def test_unsupported_parameter_is_the_proxys_400_before_any_leg(stack) -> None:
    """Our workers' refusal, in their words, from the proxy: no leg is sent (none fails)."""
    proxy = stack[0]
    failed_legs = metric_sum(proxy.url, "proxy_upstream_errors_total")
    for body in ({"prompt": PROMPT, "use_beam_search": True}, {"prompt": PROMPT, "best_of": 2}):
        reply = httpx.post(f"{proxy.url}/v1/completions", timeout=30,
                           json={"model": "neuron-di-builtin", **body, **SAMPLING})
        param = next(iter(body.keys() - {"prompt"}))
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == param
        assert reply.json()["error"]["message"].startswith(f"`{param}` is not supported by this server")
    assert metric_sum(proxy.url, "proxy_upstream_errors_total") == failed_legs


@pytest.mark.slow
def test_out_of_vocabulary_prompt_is_400_and_decode_logs_no_unretrieved_future() -> None:
    busy = {"prompt": list(range(5, 200)), "max_tokens": 1500, "ignore_eos": True}
    with worker_pair("shm", decode_extra=["--shutdown-grace", "0"]) as (prefill, decode), \
            proxy_for(prefill, decode) as proxy:
        with ThreadPoolExecutor(BUSY) as pool:
            # A busy decode engine admits between steps: the proxy, answered by prefill's 400 first,
            # drops the decode leg before decode refused the prompt itself.
            for _ in range(BUSY):
                pool.submit(httpx.post, f"{decode.url}/v1/completions", json=busy, timeout=300)
            wait_until(lambda: decode.metric("neuron_di_requests_running") == BUSY, what="decode busy")
            for _ in range(20):
                reply = httpx.post(f"{proxy.url}/v1/completions", timeout=30,
                                   json={"model": "neuron-di-builtin", "prompt": [100_000, 5], **SAMPLING})
                assert reply.status_code == 400
                assert reply.json()["error"]["message"].startswith("prompt token ids must be ints in [0, ")
            decode.stop()  # ends the busy requests; a future left unread is reported at exit at the latest
    assert "Future exception was never retrieved" not in decode.proc.output()


@pytest.mark.slow  # by default tests/proxy/test_flow_failures.py kills a prefill worker mid-request in each flow
def test_dead_prefill_worker_is_a_clear_error_and_decode_frees_its_blocks() -> None:
    # tcp: a killed shm worker cannot unlink its pool segment
    prefill, decode = WorkerProcess("prefill", "tcp"), WorkerProcess("decode", "tcp", ["--kv-pull-timeout", "5"])
    proxy = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                         "--prefill-kv-port", str(prefill.kv_port),
                         "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port)])
    try:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0, timeout=60)
        assert client.completions.create(model="neuron-di-builtin", prompt=PROMPT, **SAMPLING).choices[0].text
        prefill.proc.kill()
        with pytest.raises(openai.APIStatusError) as failure:
            client.completions.create(model="neuron-di-builtin", prompt=PROMPT, **SAMPLING)
        assert failure.value.status_code >= 500
        assert failure.value.body["message"]  # an OpenAI-style error body, not a bare status
        decode.wait_blocks_free()
    finally:
        proxy.process.stop()
        decode.stop()
        prefill.stop()


@pytest.mark.slow  # tests/di/test_failures.py fails pulls from a dead or silent prefill worker by default
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_failed_kv_transfer_is_a_kv_transfer_error_naming_the_prefill_peer(stream: bool) -> None:
    body = {"model": "neuron-di-builtin", "prompt": PROMPT, "stream": stream, **SAMPLING}
    # Health checks far apart: decode's pull times out before the proxy finds the frozen prefill worker.
    with worker_pair("shm", ["--kv-abort-timeout", "2"], ["--kv-pull-timeout", "2"]) as (prefill, decode), \
            proxy_for(prefill, decode, ["--health-interval", "60"]) as proxy:
        assert httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60).status_code == 200  # linked
        os.kill(prefill.proc.pid, signal.SIGSTOP)  # hung: it answers neither its leg nor decode's pull
        try:
            reply = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        assert reply.status_code == 503, reply.text  # decode failed before any token: a status, even streamed
        assert reply.headers["Retry-After"] == "1"
        error = reply.json()["error"]
        assert error["type"] == "kv_transfer_error" and error["code"] == 503
        assert error["message"].startswith(f"decode worker 127.0.0.1:{decode.port}: KV transfer of request ")
        assert f"prefill peer 127.0.0.1:{prefill.kv_port} " in error["message"]
        decode.wait_blocks_free()
        prefill.wait_blocks_free()


@contextmanager
def proxy_for(prefill: WorkerProcess, decode: WorkerProcess, extra: Sequence[str] = ()) -> Iterator[Server]:
    """A proxy in front of one prefill and one decode worker, always stopped."""
    proxy = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                         "--prefill-kv-port", str(prefill.kv_port),
                         "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port), *extra])
    try:
        yield proxy
    finally:
        proxy.process.stop()
