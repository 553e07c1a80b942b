"""Through the proxy to fake 1P1D workers, the official openai client sees what a single server sends."""
from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.proxy.conftest import Pair

PROMPT = "the quick brown fox jumps over"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _strip_ids(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in c.items() if k not in ("id", "created")} for c in chunks]


def _stream(client: openai.OpenAI, chat: bool, **kwargs: Any) -> list[dict[str, Any]]:
    if chat:
        stream = client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True, **kwargs)
    else:
        stream = client.completions.create(model="fake-model", prompt=PROMPT, stream=True, **kwargs)
    return [chunk.model_dump(exclude_unset=True) for chunk in stream]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
def test_stream_equals_single_server(pair: Pair, chat: bool, include_usage: bool) -> None:
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    via_proxy = _stream(_client(pair.proxy.url), chat, max_tokens=6, **extra)
    direct = _stream(_client(pair.single.url), chat, max_tokens=6, **extra)
    assert _strip_ids(via_proxy) == _strip_ids(direct)
    assert len({c["id"] for c in via_proxy}) == 1
    assert via_proxy[0]["id"].startswith("chatcmpl-" if chat else "cmpl-")
    assert len({c["created"] for c in via_proxy}) == 1
    finishes = [ch["finish_reason"] for c in via_proxy for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes == ["length"]
    assert sum(1 for c in via_proxy if c.get("usage")) == (1 if include_usage else 0)
    if include_usage:
        assert via_proxy[-1]["usage"]["completion_tokens"] == 6


def test_non_stream_completion_equals_single_server(pair: Pair) -> None:
    via_proxy = _client(pair.proxy.url).completions.create(model="fake-model", prompt=PROMPT, max_tokens=5)
    direct = _client(pair.single.url).completions.create(model="fake-model", prompt=PROMPT, max_tokens=5)
    assert via_proxy.choices[0].text == direct.choices[0].text
    assert via_proxy.choices[0].text.count(" w") == 5
    assert via_proxy.choices[0].finish_reason == "length"
    assert via_proxy.usage == direct.usage
    assert via_proxy.usage.completion_tokens == 5
    assert via_proxy.id.startswith("cmpl-") and via_proxy.id != direct.id


def test_non_stream_chat_equals_single_server(pair: Pair) -> None:
    via_proxy = _client(pair.proxy.url).chat.completions.create(model="fake-model", messages=MESSAGES,
                                                                max_completion_tokens=4)
    direct = _client(pair.single.url).chat.completions.create(model="fake-model", messages=MESSAGES,
                                                              max_completion_tokens=4)
    assert via_proxy.choices[0].message.content == direct.choices[0].message.content
    assert via_proxy.choices[0].message.role == "assistant"
    assert via_proxy.usage == direct.usage
    assert via_proxy.id.startswith("chatcmpl-")


def test_both_legs_carry_one_request_id_and_the_contract(pair: Pair) -> None:
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", timeout=30,
                       json={"model": "fake-model", "prompt": "contract check", "max_tokens": 3, "top_p": 0.5})
    assert reply.status_code == 200
    uid = reply.json()["id"].removeprefix("cmpl-")
    prefill_leg = next(leg for leg in pair.prefill.state()["legs"] if leg["uid"] == uid)
    decode_leg = next(leg for leg in pair.decode.state()["legs"] if leg["uid"] == uid)
    assert prefill_leg["kv_transfer_params"] == {"role": "prefill", "request_id": uid}
    assert (prefill_leg["max_tokens"], prefill_leg["stream"]) == (1, False)
    assert decode_leg["kv_transfer_params"] == {
        "role": "decode", "request_id": uid, "remote_host": "127.0.0.1", "remote_port": 15000}
    assert decode_leg["max_tokens"] == 3


def test_eos_at_first_token_streamed_answers_from_prefill(pair: Pair) -> None:
    steer = {"extra_body": {"fake": {"eos_at": 1}}}
    via_proxy = _stream(_client(pair.proxy.url), False, max_tokens=8, **steer)
    assert _strip_ids(via_proxy) == _strip_ids(_stream(_client(pair.single.url), False, max_tokens=8, **steer))
    assert [c["choices"][0]["finish_reason"] for c in via_proxy] == ["stop"]


def test_eos_at_first_token_whole_answers_from_prefill(pair: Pair) -> None:
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 8, "fake": {"eos_at": 1}}
    via_proxy = httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=30).json()
    direct = httpx.post(f"{pair.single.url}/v1/completions", json=body, timeout=30).json()
    assert via_proxy["choices"] == direct["choices"] and via_proxy["usage"] == direct["usage"]
    assert via_proxy["choices"][0]["finish_reason"] == "stop"


def test_eos_later_stops_the_stream_once(pair: Pair) -> None:
    via_proxy = _stream(_client(pair.proxy.url), True, max_tokens=8, extra_body={"fake": {"eos_at": 3}})
    direct = _stream(_client(pair.single.url), True, max_tokens=8, extra_body={"fake": {"eos_at": 3}})
    assert _strip_ids(via_proxy) == _strip_ids(direct)
    assert [ch["finish_reason"] for c in via_proxy for ch in c["choices"] if ch.get("finish_reason")] == ["stop"]


def test_max_tokens_one_is_one_ordinary_prefill_request(pair: Pair) -> None:
    before = len(pair.decode.state()["legs"])
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", timeout=30,
                       json={"model": "fake-model", "prompt": "one token only", "max_tokens": 1})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["text"].count(" w") == 1
    uid = reply.headers.get("x-request-id") or reply.json()["id"].removeprefix("cmpl-")
    leg = next(leg for leg in pair.prefill.state()["legs"] if leg["uid"] == uid)
    assert leg["leg"] == "single" and leg["kv_transfer_params"] == {}
    assert len(pair.decode.state()["legs"]) == before


def test_models_health_and_metrics(pair: Pair) -> None:
    models = httpx.get(f"{pair.proxy.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    health = httpx.get(f"{pair.proxy.url}/health", timeout=10).json()
    assert health["workers"] == {"prefill": {"known": 1, "healthy": 1}, "decode": {"known": 1, "healthy": 1},
                                 "both": {"known": 0, "healthy": 0}}
    metrics = httpx.get(f"{pair.proxy.url}/metrics", timeout=10).text
    for name in ("proxy_requests_total", "proxy_time_to_first_token_seconds_bucket",
                 "proxy_inter_token_latency_seconds_bucket", "proxy_request_latency_seconds_count",
                 "proxy_worker_inflight_requests", "proxy_upstream_errors"):
        assert name in metrics
    assert 'proxy_requests_total{endpoint="/v1/completions",status="200"}' in metrics
