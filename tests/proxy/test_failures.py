"""Failures: each leg's error, timeout and death; client disconnects; bad input; no workers."""
from __future__ import annotations

import json
import os
import signal
import uuid
from typing import Any, Callable

import httpx
import pytest

from tests.body_limit import assert_clients_see_413
from tests.helpers import wait_until
from tests.proxy.conftest import Pair, Server, start_fake_worker, start_proxy


def _body(fake: dict[str, Any], stream: bool = False, max_tokens: int = 6) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "a b c", "max_tokens": max_tokens, "stream": stream,
            "user": uuid.uuid4().hex, "fake": fake}


def _leg(server: Server, user: str) -> dict[str, Any]:
    return next(leg for leg in server.state()["legs"] if leg["user"] == user)


def _cancelled_and_idle(server: Server, user: str) -> None:
    """The worker saw the proxy drop this leg, and holds no request any more."""
    def done() -> bool:
        state = server.state()
        uid = next(leg["uid"] for leg in state["legs"] if leg["user"] == user)
        return uid in state["cancelled"] and state["active"] == 0
    wait_until(done, timeout=10, what=f"leg of {user} cancelled on {server.url}")


def _sse(text: str) -> list[Any]:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prefill_error_status_is_502_and_decode_is_cancelled(pair: Pair, stream: bool) -> None:
    body = _body({"prefill": {"status": 500}, "decode": {"hang": True}}, stream)
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert error["type"] == "upstream_error" and error["code"] == 502
    assert f"prefill worker 127.0.0.1:{pair.prefill.port}: answered HTTP 500" in error["message"]
    _cancelled_and_idle(pair.decode, body["user"])
    metrics = httpx.get(f"{pair.proxy.url}/metrics", timeout=10).text
    assert 'proxy_upstream_errors_total{kind="UpstreamStatus",role="prefill"}' in metrics
    assert 'proxy_requests_total{endpoint="/v1/completions",status="502"}' in metrics


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_decode_error_fails_at_once_and_cancels_prefill(pair: Pair, stream: bool) -> None:
    body = _body({"prefill": {"hang": True}, "decode": {"status": 503}}, stream)
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 502
    assert "decode worker" in reply.json()["error"]["message"]
    _cancelled_and_idle(pair.prefill, body["user"])


def test_worker_4xx_is_passed_through_with_its_body(pair: Pair) -> None:
    body = _body({"prefill": {"status": 422}, "decode": {"hang": True}})
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 422
    assert reply.json() == {"error": {"message": "fake failure", "type": "fake", "param": None, "code": 422}}
    _cancelled_and_idle(pair.decode, body["user"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prefill_timeout_is_504_and_decode_is_cancelled(pair: Pair, stream: bool) -> None:
    body = _body({"prefill": {"hang": True}, "decode": {"hang": True}}, stream)
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 504
    assert reply.json()["error"]["type"] == "upstream_timeout"
    _cancelled_and_idle(pair.decode, body["user"])
    _cancelled_and_idle(pair.prefill, body["user"])


def test_decode_timeout_mid_stream_is_an_sse_error(pair: Pair) -> None:
    body = _body({"decode": {"delay": 5}}, stream=True)
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200
    events = _sse(reply.text)
    assert events[0]["choices"][0]["text"].startswith(" w")  # prefill's token went out first
    assert events[-2]["error"]["type"] == "upstream_timeout" and events[-1] == "[DONE]"
    _cancelled_and_idle(pair.decode, body["user"])


def _inflight(pair: Pair, server: Server, role: str) -> float:
    metrics = httpx.get(f"{pair.proxy.url}/metrics", timeout=10).text
    line = f'proxy_worker_inflight_requests{{role="{role}",worker="127.0.0.1:{server.port}"}} '
    return float(metrics.split(line)[1].split()[0])


def test_client_disconnect_mid_stream_cancels_the_decode_leg(pair: Pair) -> None:
    body = _body({"decode": {"delay": 0.3}}, stream=True, max_tokens=50)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{pair.proxy.url}/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert next(line for line in lines if line.startswith("data: "))
            assert _inflight(pair, pair.decode, "decode") == 1
    _cancelled_and_idle(pair.decode, body["user"])
    assert pair.prefill.state()["active"] == 0
    wait_until(lambda: _inflight(pair, pair.decode, "decode") == 0, timeout=10, what="in-flight gauge back to 0")


def test_client_disconnect_before_the_first_token_cancels_both_legs(pair: Pair) -> None:
    body = _body({"prefill": {"hang": True}, "decode": {"hang": True}}, stream=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    _cancelled_and_idle(pair.prefill, body["user"])
    _cancelled_and_idle(pair.decode, body["user"])


def _all_cancelled_and_idle(server: Server, user: str, count: int) -> None:
    """The worker saw the proxy drop `count` legs of this client request, and holds no request any more."""
    def done() -> bool:
        state = server.state()
        uids = {leg["uid"] for leg in state["legs"] if leg["user"] == user}
        return len(uids & set(state["cancelled"])) == count and state["active"] == 0
    wait_until(done, timeout=10, what=f"{count} legs of {user} cancelled on {server.url}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_one_failed_answer_of_several_fails_the_request_and_cancels_the_others(pair: Pair, stream: bool) -> None:
    body = {**_body({"decode": {"hang": True}, "by_prompt": {"b": {"decode": {"status": 503}}}}, stream),
            "prompt": ["a", "b", "c"]}
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", json=body, timeout=30)
    if reply.status_code == 200:  # streamed, answers started with prefill's tokens: the error ends the stream
        assert stream
        events = _sse(reply.text)
        assert reply.status_code == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert "decode worker" in events[-2]["error"]["message"]
    else:
        assert reply.status_code == 502 and "decode worker" in reply.json()["error"]["message"]
    _all_cancelled_and_idle(pair.decode, body["user"], 2)  # a's and c's; b's answered its 503
    assert pair.prefill.state()["active"] == 0


def test_client_disconnect_mid_stream_of_several_answers_cancels_every_decode_leg(pair: Pair) -> None:
    body = {**_body({"decode": {"delay": 0.3}}, stream=True, max_tokens=50), "prompt": ["a", "b"], "n": 2,
            "temperature": 0.5}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{pair.proxy.url}/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            firsts = [json.loads(next(line for line in lines if line.startswith("data: "))[6:]) for _ in range(4)]
            assert {c["choices"][0]["index"] for c in firsts} == {0, 1, 2, 3}  # each answer's first token
    _all_cancelled_and_idle(pair.decode, body["user"], 4)
    wait_until(lambda: _inflight(pair, pair.decode, "decode") == 0, timeout=10, what="in-flight gauge back to 0")


BAD_BODIES: list[tuple[str, bytes]] = [
    ("not json", b"{nope"),
    ("not an object", b"[1, 2]"),
    ("no model", json.dumps({"prompt": "x"}).encode()),
    ("model not a string", json.dumps({"model": 3, "prompt": "x"}).encode()),
    ("no prompt", json.dumps({"model": "m"}).encode()),
    ("empty prompt", json.dumps({"model": "m", "prompt": ""}).encode()),
    ("prompt of dicts", json.dumps({"model": "m", "prompt": [{"a": 1}]}).encode()),
    ("max_tokens negative", json.dumps({"model": "m", "prompt": "x", "max_tokens": -1}).encode()),
    ("max_tokens string", json.dumps({"model": "m", "prompt": "x", "max_tokens": "5"}).encode()),
    ("max_tokens bool", json.dumps({"model": "m", "prompt": "x", "max_tokens": True}).encode()),
    ("stream not bool", json.dumps({"model": "m", "prompt": "x", "stream": "yes"}).encode()),
    ("n zero", json.dumps({"model": "m", "prompt": "x", "n": 0}).encode()),
    ("more than 256 answers", json.dumps({"model": "m", "prompt": ["x"] * 100, "n": 3}).encode()),
    ("seed above int64", json.dumps({"model": "m", "prompt": "x", "seed": 2**100}).encode()),
    ("nested beyond the recursion limit", b"[" * 100_000 + b"]" * 100_000),
    ("nested 500 levels in an unknown key",
     b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 500 + b"]" * 500 + b"}"),
]


@pytest.mark.parametrize("name,raw", BAD_BODIES, ids=[name for name, _ in BAD_BODIES])
def test_bad_input_is_400_before_any_worker(pair: Pair, name: str, raw: bytes) -> None:
    before = len(pair.prefill.state()["legs"]), len(pair.decode.state()["legs"])
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", content=raw, timeout=10,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["message"]
    assert (len(pair.prefill.state()["legs"]), len(pair.decode.state()["legs"])) == before


def test_unknown_path_and_wrong_method_answer_openai_errors(pair: Pair) -> None:
    missing = httpx.post(f"{pair.proxy.url}/v1/embeddings", json={}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = httpx.get(f"{pair.proxy.url}/v1/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405


def test_bad_chat_messages_are_400(pair: Pair) -> None:
    for messages in ([], "hi", [{"content": "no role"}]):
        reply = httpx.post(f"{pair.proxy.url}/v1/chat/completions", timeout=10,
                           json={"model": "m", "messages": messages})
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "messages"


def test_decode_death_mid_stream_is_an_sse_error_and_leaves_rotation(
        servers: Callable[[Server], Server]) -> None:
    prefill = servers(start_fake_worker("prefill"))
    decode = servers(start_fake_worker("decode"))
    proxy = servers(start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                                 "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port),
                                 "--health-interval", "0.5"]))
    body = _body({"decode": {"die_after": 3}}, stream=True)
    reply = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200
    events = _sse(reply.text)
    # prefill's token and the two tokens decode sent after its repeat, then the error
    assert len(events) == 5
    assert all(e["choices"][0]["text"].startswith(" w") for e in events[:3])
    # In the stack's words, not the HTTP client's ("ClientPayloadError: ... TransferEncodingError: 400 ...").
    assert events[-2]["error"] == {
        "message": f"decode worker 127.0.0.1:{decode.port}: closed the connection in the middle of its answer "
                   "(the worker stopped or crashed?)", "type": "upstream_error", "param": None, "code": 502}
    assert events[-1] == "[DONE]" and sum(1 for e in events if e == "[DONE]") == 1
    assert decode.process.proc.wait(timeout=10) == 1
    assert prefill.state()["active"] == 0
    # Out of rotation, and a request names it and why, first as the failed leg found it, then as the health
    # checks do.
    gone = (f"no healthy decode worker with kv_protocol 'neuron' is available; decode worker 127.0.0.1:{decode.port}:"
            " connection refused (nothing listens there: the worker is not started yet, or stopped?)")
    wait_until(lambda: httpx.post(f"{proxy.url}/v1/completions", json=_body({}), timeout=30).json()["error"]["message"]
               == gone, timeout=10, what="the health checks' reason")


def test_refused_connection_is_502_and_takes_the_worker_out(servers: Callable[[Server], Server]) -> None:
    prefill = servers(start_fake_worker("prefill"))
    decode = servers(start_fake_worker("decode"))
    # Health checks far apart: only the failed leg itself can take the worker out of rotation.
    proxy = servers(start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                                 "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port),
                                 "--health-interval", "60"]))
    assert httpx.post(f"{proxy.url}/v1/completions", json=_body({}), timeout=30).status_code == 200
    prefill.process.kill()
    body = _body({"decode": {"hang": True}})
    reply = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 502
    assert reply.json()["error"]["message"] == (f"prefill worker 127.0.0.1:{prefill.port}: connection refused "
                                                "(nothing listens there: the worker is not started yet, or stopped?)")
    _cancelled_and_idle(decode, body["user"])
    after = httpx.post(f"{proxy.url}/v1/completions", json=_body({}), timeout=30)
    assert after.status_code == 503


def test_sigterm_mid_stream_ends_the_stream_with_an_error_event_and_drops_the_decode_leg(
        servers: Callable[[Server], Server]) -> None:
    prefill = servers(start_fake_worker("prefill"))
    decode = servers(start_fake_worker("decode"))
    proxy = servers(start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                                 "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port),
                                 "--shutdown-grace", "0"]))
    body = _body({"decode": {"delay": 1.0}}, stream=True, max_tokens=30)
    events: list[Any] = []
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=30) as reply:
        for line in reply.iter_lines():  # a cut connection raises here
            if line.startswith("data: "):
                events.append(json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]")
                if len(events) == 1:
                    os.kill(proxy.process.pid, signal.SIGTERM)
    assert proxy.process.proc.wait(timeout=30) == 0
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "the proxy is shutting down", "type": "service_unavailable",
                                    "param": None, "code": 503}}
    assert all("choices" in event for event in events[:-2])
    _cancelled_and_idle(decode, body["user"])


def test_a_body_over_the_limit_is_a_413_clients_read_and_the_proxy_keeps_serving(pair: Pair) -> None:
    assert_clients_see_413(pair.proxy.url)
    reply = httpx.post(f"{pair.proxy.url}/v1/completions", json=_body({}), timeout=30)
    assert reply.status_code == 200, reply.text


def test_a_refused_connection_sends_the_leg_to_another_worker_of_its_role(servers: Callable[[Server], Server]) -> None:
    """A worker that exited (say, drained) before the proxy saw it go: its refused legs are resent, once."""
    prefills = [servers(start_fake_worker("prefill")) for _ in range(2)]
    decodes = [servers(start_fake_worker("decode")) for _ in range(2)]
    # Health checks far apart: the proxy still counts the stopped workers in when the legs are sent.
    proxy = servers(start_proxy([*(a for p in prefills for a in ("--prefill", f"127.0.0.1:{p.port}")),
                                 *(a for d in decodes for a in ("--decode", f"127.0.0.1:{d.port}")),
                                 "--health-interval", "600"]))
    prefills[0].process.kill()
    decodes[0].process.kill()
    for _ in range(4):
        assert httpx.post(f"{proxy.url}/v1/completions", json=_body({}), timeout=30).status_code == 200
