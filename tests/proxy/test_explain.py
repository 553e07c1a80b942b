"""A `vllm serve` decode worker answers a failed KV pull with a bare HTTP 500; the proxy asks its
connector's status server why, and the client gets the kv_transfer_error naming the prefill peer."""
from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

from tests.proxy.conftest import Pair, Server, start_proxy

WHY = "pull of 'x': prefill peer 127.0.0.1:15000 did not complete the handshake before the deadline"


@pytest.fixture(scope="module")
def proxy(pair: Pair) -> Iterator[Server]:
    """A proxy that knows the decode worker's status port (the fake serves GET /timeline itself)."""
    server = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(pair.prefill.port),
                          "--prefill-kv-port", "15000", "--decode-ip", "127.0.0.1",
                          "--decode-port", str(pair.decode.port), "--decode-status-port", str(pair.decode.port)])
    yield server
    server.process.stop()


def post(url: str, stream: bool, decode: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30, json={
        "model": "fake-model", "prompt": "pull me", "max_tokens": 4, "stream": stream, "fake": {"decode": decode}})


def explanation(reply: httpx.Response) -> dict:
    """The error the client got: a 503 answer, or, when prefill's first token went out before the decode
    leg failed (concurrent flow), the error event ending its 200 stream."""
    if reply.status_code == 200:
        return json.loads([line for line in reply.text.splitlines() if '"error"' in line][0][6:])["error"]
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    return reply.json()["error"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_failed_pull_is_a_kv_transfer_error_naming_the_peer(pair: Pair, proxy: Server, stream: bool) -> None:
    reply = post(proxy.url, stream, {"status": 500, "pull_error": WHY})
    assert stream or reply.status_code == 503
    error = explanation(reply)
    assert error["type"] == "kv_transfer_error" and error["code"] == 503
    assert error["message"].startswith(f"decode worker 127.0.0.1:{pair.decode.port}: KV transfer of request ")
    assert WHY in error["message"]


def test_another_failure_stays_what_it_was(pair: Pair, proxy: Server) -> None:
    reply = post(proxy.url, False, {"status": 500})
    assert reply.status_code == 502 and reply.json()["error"]["type"] == "upstream_error"


def test_a_stream_vllm_failed_in_band_is_explained_too(pair: Pair, proxy: Server) -> None:
    """vLLM answers 200 and ends the stream with its bare error event when the pull fails after the stream
    began; the client gets the explanation either way the race with prefill's first token goes."""
    error = explanation(post(proxy.url, True, {"pull_error": WHY}))
    assert error["type"] == "kv_transfer_error" and WHY in error["message"]
