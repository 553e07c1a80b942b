"""Our proxy over vLLM 1P1D with NeuronConnector (found in etcd) answers exactly as one plain `vllm serve`.

Every server runs vLLM's defaults, chunked prefill on: eight seeded prompts of up to 1000 tokens at
once do not fit one step's 2048-token budget on the prefill server, which prefills some in chunks (the
path on which vLLM's CPU build stops its engine for a seeded request; its prefill legs go unseeded)."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from stack.serving import Stack
from stack.vllm import SERVED_NAME
from stack.etcd import EtcdServer
from stack.worker_metrics import metric
from tests.helpers import wait_until
from tests.proxy.registration import registered_workers
from tests.timeline_checks import assert_phases_add_up, request_timeline, uid_of
from tests.vllm.client import answers, body

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")

NUM_PROMPTS = 50
MAX_TOKENS = 8
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]
# (stream, concurrency): greedy streamed eight at once by default, the other three with --full (whole answers
# are compared in every flow of tests/vllm/test_flows.py); seeded sampling takes the same path: it is there to
# catch bad KV.
GREEDY_WAYS, MORE_GREEDY_WAYS, SEEDED_WAYS = ((True, 8),), ((False, 1), (False, 8), (True, 1)), ((True, 8),)


def prompts() -> list[str]:
    """50 prompts of 1..1000 bytes (the built-in tokenizer is byte level: one token per byte)."""
    rng = random.Random(7)
    lengths = [1 + round(i * 999 / (NUM_PROMPTS - 1)) for i in range(NUM_PROMPTS)]
    return ["".join(chr(rng.randrange(32, 127)) for _ in range(n)) for n in lengths]


def payloads(endpoint: str, stream: bool, sampled: bool) -> list[dict]:
    # Seeded sampling makes a wrong KV block show: greedy output of the built-in model repeats itself.
    return [body(endpoint, p, MAX_TOKENS, stream, **({"temperature": 0.9, "seed": i} if sampled
                                                      else {"temperature": 0}))
            for i, p in enumerate(prompts())]


def test_vllm_workers_register_in_etcd(etcd: EtcdServer, neuron_stack: Stack) -> None:
    records = {r.role: r for r in registered_workers(etcd.endpoint)}
    assert sorted(records) == ["decode", "prefill"]
    for role, record in records.items():
        assert record.base_url == neuron_stack.worker_urls[role] and record.kv_protocol == "neuron"
        assert record.model == SERVED_NAME
    assert records["prefill"].kv_port == neuron_stack.kv_ports["prefill"]


def test_sampled_requests_without_a_seed_under_load(neuron_stack: Stack) -> None:
    """The proxy seeds them; eight long prompts at once must neither fail nor stop a server."""
    rng = random.Random(3)
    long_prompts = ["".join(chr(rng.randrange(32, 127)) for _ in range(1000)) for _ in range(8)]
    got = asyncio.run(answers(neuron_stack.url, "/v1/completions",
                              [body("/v1/completions", p, MAX_TOKENS, False) for p in long_prompts], 8))
    assert [g.completion_tokens for g in got] == [MAX_TOKENS] * 8
    kv_usage_back_to_zero(neuron_stack)


def test_timeline_phases_add_up(neuron_stack: Stack) -> None:
    """One streamed request's phases, from the proxy and both connectors' status servers (GET /timeline)."""
    payload = body("/v1/completions", "where did my time go? " * 20, MAX_TOKENS, True, temperature=0)
    reply = httpx.post(neuron_stack.url + "/v1/completions", json=payload, timeout=60)
    assert reply.status_code == 200, reply.text
    uid = uid_of(json.loads(reply.text.split("data: ", 1)[1].split("\n", 1)[0])["id"])
    path = assert_phases_add_up(request_timeline(neuron_stack.timeline_urls(), uid), streamed=True)
    assert path[-1][1] > 0
    kv_usage_back_to_zero(neuron_stack)


def kv_usage_back_to_zero(stack: Stack) -> None:
    for url in stack.worker_urls.values():
        wait_until(lambda: metric(url, "vllm:kv_cache_usage_perc") == 0.0, timeout=30,
                   what=f"KV usage of {url} back to 0")


def assert_answers_like_reference(reference: Stack, stack: Stack, endpoint: str, sampled: bool,
                                  ways: tuple[tuple[bool, int], ...]) -> None:
    """50 prompts, each (stream, concurrency) of `ways`: what `reference` answers, token for token."""
    want = asyncio.run(answers(reference.url, endpoint, payloads(endpoint, False, sampled), concurrency=1))
    assert all(w.completion_tokens == MAX_TOKENS for w in want)
    for stream, concurrency in ways:
        got = asyncio.run(answers(stack.url, endpoint, payloads(endpoint, stream, sampled), concurrency))
        mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not mismatched, (f"stream={stream} concurrency={concurrency}: prompts {mismatched} differ, "
                                f"first: {got[mismatched[0]]} != {want[mismatched[0]]}")
        kv_usage_back_to_zero(stack)
    assert metric(stack.url, "proxy_first_token_mismatches_total") == 0


def cases() -> list:
    """endpoint x (greedy, seeded, greedy-more-ways). By default completions greedy and chat seeded, which between
    them cover each endpoint and each sampling once (as every flow of tests/vllm/test_flows.py does); the rest
    with --full."""
    default = {("greedy", "/v1/completions"), ("seeded", "/v1/chat/completions")}
    return [pytest.param(endpoint, sampled, ways, id=f"{endpoint}-{name}",
                         marks=[] if (name, endpoint) in default else [pytest.mark.slow])
            for name, sampled, ways in (("greedy", False, GREEDY_WAYS), ("seeded", True, SEEDED_WAYS),
                                        ("greedy-more-ways", False, MORE_GREEDY_WAYS))
            for endpoint in ENDPOINTS]


@pytest.mark.parametrize("endpoint, sampled, ways", cases())
def test_1p1d_equals_one_vllm_server(reference: Stack, neuron_stack: Stack, endpoint: str, sampled: bool,
                                     ways: tuple[tuple[bool, int], ...]) -> None:
    assert_answers_like_reference(reference, neuron_stack, endpoint, sampled, ways)
