"""--kv-protocol nixl: vLLM's NixlConnector handoff, prefill first, then decode with what prefill answered."""
from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from tests.proxy.conftest import Pair, Server
from tests.proxy.fake_worker import nixl_handoff
from tests.proxy.test_stitched_output import MESSAGES, PROMPT, _client, _stream, _strip_ids

NIXL_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _legs(server: Server, uid: str) -> list[dict[str, Any]]:
    return [leg for leg in server.state()["legs"] if leg["uid"] == uid]


def test_legs_follow_vllms_handoff_one_after_the_other(nixl_pair: Pair) -> None:
    body = {"model": "fake-model", "prompt": "handoff check", "max_tokens": 3, "top_p": 0.5,
            "user": uuid.uuid4().hex}
    reply = httpx.post(f"{nixl_pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200
    uid = reply.json()["id"].removeprefix("cmpl-")
    [prefill_leg], [decode_leg] = _legs(nixl_pair.prefill, uid), _legs(nixl_pair.decode, uid)
    seed = prefill_leg["body"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**31
    assert prefill_leg["body"] == {**body, "max_tokens": 1, "stream": False, "seed": seed,
                                   "kv_transfer_params": NIXL_PREFILL}
    # decode got exactly the kv_transfer_params of prefill's answer (block ids derived from this request's id)
    assert decode_leg["body"] == {**body, "seed": seed, "kv_transfer_params": nixl_handoff(uid, 15000)}
    assert (prefill_leg["leg"], decode_leg["leg"]) == ("prefill", "decode")
    direct = httpx.post(f"{nixl_pair.single.url}/v1/completions", json=body, timeout=30).json()
    assert reply.json()["choices"] == direct["choices"] and reply.json()["usage"] == direct["usage"]
    assert "kv_transfer_params" not in reply.json()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_equals_single_server(nixl_pair: Pair, chat: bool) -> None:
    extra = {"stream_options": {"include_usage": True}}
    via_proxy = _stream(_client(nixl_pair.proxy.url), chat, max_tokens=6, **extra)
    assert _strip_ids(via_proxy) == _strip_ids(_stream(_client(nixl_pair.single.url), chat, max_tokens=6, **extra))
    assert len({c["id"] for c in via_proxy}) == 1
    assert via_proxy[-1]["usage"]["completion_tokens"] == 6
    uid = via_proxy[0]["id"].removeprefix("chatcmpl-" if chat else "cmpl-")
    [prefill_leg], [decode_leg] = _legs(nixl_pair.prefill, uid), _legs(nixl_pair.decode, uid)
    assert "stream_options" not in prefill_leg["body"] and prefill_leg["body"]["stream"] is False
    assert decode_leg["body"]["stream"] is True and decode_leg["body"]["stream_options"] == {"include_usage": True}
    assert decode_leg["kv_transfer_params"] == nixl_handoff(uid, 15000)


def test_whole_chat_equals_single_server(nixl_pair: Pair) -> None:
    kwargs = {"model": "fake-model", "messages": MESSAGES, "max_completion_tokens": 4}
    via_proxy = _client(nixl_pair.proxy.url).chat.completions.create(**kwargs)
    direct = _client(nixl_pair.single.url).chat.completions.create(**kwargs)
    assert via_proxy.choices[0].message.content == direct.choices[0].message.content
    assert via_proxy.choices[0].message.content.count(" w") == 4
    assert via_proxy.usage == direct.usage
    [prefill_leg] = _legs(nixl_pair.prefill, via_proxy.id.removeprefix("chatcmpl-"))
    assert (prefill_leg["body"]["max_tokens"], prefill_leg["body"]["max_completion_tokens"]) == (1, 1)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_eos_at_first_token_never_calls_decode(nixl_pair: Pair, stream: bool) -> None:
    before = len(nixl_pair.decode.state()["legs"])
    if stream:
        steer = {"extra_body": {"fake": {"eos_at": 1}}}
        via_proxy = _stream(_client(nixl_pair.proxy.url), False, max_tokens=8, **steer)
        assert _strip_ids(via_proxy) == _strip_ids(_stream(_client(nixl_pair.single.url), False, max_tokens=8,
                                                           **steer))
        assert [c["choices"][0]["finish_reason"] for c in via_proxy] == ["stop"]
    else:
        body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 8, "fake": {"eos_at": 1}}
        via_proxy = httpx.post(f"{nixl_pair.proxy.url}/v1/completions", json=body, timeout=30).json()
        direct = httpx.post(f"{nixl_pair.single.url}/v1/completions", json=body, timeout=30).json()
        assert via_proxy["choices"] == direct["choices"] and via_proxy["usage"] == direct["usage"]
        assert "kv_transfer_params" not in via_proxy
    assert len(nixl_pair.decode.state()["legs"]) == before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prefill_answer_without_kv_transfer_params_is_502(nixl_pair: Pair, stream: bool) -> None:
    before = len(nixl_pair.decode.state()["legs"])
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 4, "stream": stream,
            "fake": {"prefill": {"no_handoff": True}}}
    reply = httpx.post(f"{nixl_pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 502
    assert reply.json()["error"] == {
        "message": f"prefill worker 127.0.0.1:{nixl_pair.prefill.port}: answer has no kv_transfer_params object "
                   "for decode (is it a vLLM worker with NixlConnector?)",
        "type": "upstream_error", "param": None, "code": 502}
    assert len(nixl_pair.decode.state()["legs"]) == before


def test_a_failing_prefill_ends_the_request_before_decode(nixl_pair: Pair) -> None:
    before = len(nixl_pair.decode.state()["legs"])
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 4, "fake": {"prefill": {"status": 422}}}
    reply = httpx.post(f"{nixl_pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 422
    assert reply.json() == {"error": {"message": "fake failure", "type": "fake", "param": None, "code": 422}}
    assert len(nixl_pair.decode.state()["legs"]) == before


def test_a_failing_decode_is_502_whole_and_an_sse_error_streamed(nixl_pair: Pair) -> None:
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 4, "fake": {"decode": {"status": 500}}}
    reply = httpx.post(f"{nixl_pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 502
    assert f"decode worker 127.0.0.1:{nixl_pair.decode.port}: answered HTTP 500" in reply.json()["error"]["message"]
    streamed = httpx.post(f"{nixl_pair.proxy.url}/v1/completions", json={**body, "stream": True}, timeout=30)
    assert streamed.status_code == 200
    lines = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert len(lines) == 3 and lines[-1] == "data: [DONE]"
    assert '"text":" w' in lines[0]  # prefill's token went out first
    assert f"decode worker 127.0.0.1:{nixl_pair.decode.port}: answered HTTP 500" in lines[1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_list_of_prompts_is_one_handoff_per_prompt(nixl_pair: Pair, stream: bool) -> None:
    prompts = ["first prompt", "second one", "third"]
    body = {"model": "fake-model", "prompt": prompts, "max_tokens": 4, "stream": stream, "user": uuid.uuid4().hex}
    reply = httpx.post(f"{nixl_pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200
    if stream:
        texts = ["", "", ""]
        for line in reply.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    else:
        texts = [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]
    direct = [httpx.post(f"{nixl_pair.single.url}/v1/completions", json={**body, "prompt": p, "stream": False},
                         timeout=30).json()["choices"][0]["text"] for p in prompts]
    assert texts == direct
    legs = [leg for leg in nixl_pair.decode.state()["legs"] if leg["user"] == body["user"]]
    assert sorted(leg["body"]["prompt"] for leg in legs) == sorted(prompts)
    assert len({leg["uid"] for leg in legs}) == 3  # each its own handoff
