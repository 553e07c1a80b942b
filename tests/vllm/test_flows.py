"""Every request flow over `vllm serve` with NeuronConnector answers as one plain `vllm serve`.

The session's vLLM prefill and decode servers (on vLLM's defaults, chunked prefill on) behind one
proxy per flow, found in etcd: `prefill_first` (the prefill answer's own kv_transfer_params go to
decode), `decode_first` (the decode server's connector sends the prefill leg itself) and
conditional disaggregation (short prompts prefilled by the decode server alone). Each flow answers
greedy and seeded requests, streamed and not, one and eight at a time, on both endpoints, token for
token as the reference server, and leaves every server's KV usage at 0. The concurrent flow is
tests/vllm/test_parity.py's.
"""
from __future__ import annotations

import asyncio
import random
import uuid
from typing import Iterator

import httpx
import pytest

from stack.etcd import EtcdServer
from stack.serving import Stack
from stack.vllm import SERVED_NAME
from stack.worker_metrics import metric
from tests.proxy.conftest import Server, start_proxy
from tests.vllm.client import Seen, answers, body
from tests.helpers import wait_until
from tests.vllm.conftest import ABORT_TIMEOUT, OPTIONS
from tests.vllm.test_parity import kv_usage_back_to_zero

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")

NUM_PROMPTS, MAX_TOKENS, MAX_LOCAL = 16, 8, 128
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]
FLOWS = {"prefill_first": ["--disaggregation-strategy", "prefill_first"],
         "decode_first": ["--disaggregation-strategy", "decode_first"],
         "conditional": ["--conditional-disaggregation", "--tokenizer", OPTIONS.model,
                         "--max-local-prefill-tokens", str(MAX_LOCAL), "--kv-block-size", "128"]}
# (endpoint, sampled, stream, concurrency): by default two ways per flow that between them cover each value once.
WAYS = [("/v1/completions", False, True, 8), ("/v1/chat/completions", True, False, 1)]


def prompts() -> list[str]:
    """Half short (a decode server prefills them itself with conditional disaggregation), half long."""
    rng = random.Random(11)
    lengths = [rng.randint(8, 90) if i % 2 else rng.randint(300, 1000) for i in range(NUM_PROMPTS)]
    return ["".join(chr(rng.randrange(32, 127)) for _ in range(n)) for n in lengths]


def payloads(endpoint: str, stream: bool, sampled: bool) -> list[dict]:
    return [body(endpoint, p, MAX_TOKENS, stream, **({"temperature": 0.9, "seed": i} if sampled
                                                      else {"temperature": 0}))
            for i, p in enumerate(prompts())]


@pytest.fixture(scope="module")
def proxies(etcd: EtcdServer, neuron_stack: Stack) -> Iterator[dict[str, Server]]:
    started: dict[str, Server] = {}
    try:
        for flow, flags in FLOWS.items():
            started[flow] = start_proxy(["--etcd", etcd.endpoint, *flags])
        yield started
    finally:
        for proxy in started.values():
            proxy.process.stop()


_wanted: dict[tuple[str, bool], list[Seen]] = {}


def wanted(reference: Stack, endpoint: str, sampled: bool) -> list[Seen]:
    """The reference server's answers, one at a time (a plain vLLM CPU server prefilling a seeded prompt in
    chunks, as eight long prompts at once make it, stops its engine)."""
    if (endpoint, sampled) not in _wanted:
        got = asyncio.run(answers(reference.url, endpoint, payloads(endpoint, False, sampled), concurrency=1))
        assert all(g.completion_tokens == MAX_TOKENS for g in got)
        _wanted[endpoint, sampled] = got
    return _wanted[endpoint, sampled]


def ways() -> list:
    every = [(endpoint, *way) for endpoint in ENDPOINTS
             for way in ((False, True, 8), (True, False, 1), (False, False, 1), (True, True, 8))]
    return [pytest.param(*way, id=f"{'chat' if 'chat' in way[0] else 'completions'}-{'seeded' if way[1] else 'greedy'}-"
                                  f"{'stream' if way[2] else 'whole'}-c{way[3]}",
                         marks=() if way in WAYS else pytest.mark.slow) for way in every]


@pytest.mark.parametrize("endpoint, sampled, stream, concurrency", ways())
@pytest.mark.parametrize("flow", list(FLOWS))
def test_flow_answers_as_one_vllm_server(reference: Stack, neuron_stack: Stack, proxies: dict[str, Server],
                                          flow: str, endpoint: str, sampled: bool, stream: bool,
                                          concurrency: int) -> None:
    proxy = proxies[flow]
    want = wanted(reference, endpoint, sampled)
    before = metric(proxy.url, "proxy_request_paths_total", path="local") if flow == "conditional" else 0
    got = asyncio.run(answers(proxy.url, endpoint, payloads(endpoint, stream, sampled), concurrency))
    mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not mismatched, f"prompts {mismatched} differ, first: {got[mismatched[0]]} != {want[mismatched[0]]}"
    kv_usage_back_to_zero(neuron_stack)
    if flow == "conditional" and not sampled:   # seeded requests stay remote on a vLLM decode server
        local = metric(proxy.url, "proxy_request_paths_total", path="local") - before
        assert 0 < local < NUM_PROMPTS


def test_prefill_answer_names_where_its_blocks_wait(neuron_stack: Stack) -> None:
    """What prefill_first hands to decode: the vLLM prefill server's own kv_transfer_params, which a decode
    leg then pulls from. The prefill server's /metrics shows its blocks held for the pull, 0 once pulled."""
    uid = uuid.uuid4().hex
    prefill, decode = neuron_stack.worker_urls["prefill"], neuron_stack.worker_urls["decode"]
    leg = {**body("/v1/completions", "where do my blocks wait? " * 20, 1, False, temperature=0),
           "kv_transfer_params": {"role": "prefill", "request_id": uid}}
    first = httpx.post(f"{prefill}/v1/completions", json=leg, timeout=60)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["request_id"] == uid and params["remote_port"] == neuron_stack.kv_ports["prefill"]
    assert params["remote_host"] == "127.0.0.1" and params["remote_engine_id"]
    wait_until(lambda: metric(prefill, "neuron_di_kv_blocks_held") > 0, timeout=10, what="blocks held on /metrics")
    assert metric(prefill, "neuron_di_kv_abort_timeout_seconds", model_name=SERVED_NAME, engine="0") == ABORT_TIMEOUT
    rest = httpx.post(f"{decode}/v1/completions", timeout=60, json={
        **body("/v1/completions", "where do my blocks wait? " * 20, 4, False, temperature=0),
        "kv_transfer_params": {"role": "decode", **params}})
    assert rest.status_code == 200 and rest.json()["usage"]["completion_tokens"] == 4, rest.text
    kv_usage_back_to_zero(neuron_stack)
    wait_until(lambda: metric(prefill, "neuron_di_kv_blocks_held") == metric(
        prefill, "neuron_di_kv_held_oldest_seconds") == 0, timeout=10, what="no block held once pulled")
