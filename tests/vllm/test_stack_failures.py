"""Failures of the session's vLLM 1P1D NeuronConnector stack, with real processes: nothing hangs,
nothing is held. Runs after the parity tests: its last test kills the prefill server."""
from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
import httpx
import pytest

from stack.serving import Stack
from stack.serving import Process, free_port, wait_healthy
from stack.worker_metrics import metric
from tests.helpers import wait_until
from tests.vllm.client import body
from tests.vllm.conftest import ABORT_TIMEOUT, PULL_TIMEOUT

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")

LONG_PROMPT = "a stream that the client drops " * 30


@pytest.fixture
def stack(neuron_stack: Stack) -> Stack:
    return neuron_stack


def nothing_held(url: str, timeout: float = 30.0) -> None:
    wait_until(lambda: metric(url, "vllm:kv_cache_usage_perc") == 0.0
               and metric(url, "vllm:num_requests_running") == 0
               and metric(url, "vllm:num_requests_waiting") == 0, timeout=timeout, what=f"{url} idle, KV free")


def test_client_disconnect_aborts_both_legs(stack: Stack) -> None:
    async def drop_after_first_tokens() -> int:
        async with httpx.AsyncClient(timeout=60.0) as client:
            payload = body("/v1/completions", LONG_PROMPT, 600, True, temperature=0)
            async with client.stream("POST", stack.url + "/v1/completions", json=payload) as response:
                chunks = 0
                async for _ in response.aiter_lines():
                    chunks += 1
                    if chunks == 6:
                        return chunks   # leaving the block closes the connection mid-stream
        return chunks

    assert asyncio.run(drop_after_first_tokens()) == 6
    for url in stack.worker_urls.values():
        nothing_held(url)


def test_unpulled_blocks_are_freed_after_the_abort_timeout(stack: Stack) -> None:
    """The prefill leg of a request whose decode worker is gone: published, never pulled."""
    prefill = stack.worker_urls["prefill"]
    payload = {**body("/v1/completions", LONG_PROMPT, 1, False, temperature=0),
               "kv_transfer_params": {"role": "prefill", "request_id": uuid.uuid4().hex}}
    response = httpx.post(prefill + "/v1/completions", json=payload, timeout=60.0)
    assert response.status_code == 200, response.text
    held_at = time.monotonic()
    assert metric(prefill, "vllm:kv_cache_usage_perc") > 0     # its blocks wait for a pull
    assert metric(prefill, "neuron_di_kv_blocks_held") > 0      # and /metrics says how many, and for how long
    wait_until(lambda: metric(prefill, "neuron_di_kv_held_oldest_seconds") >= 2, timeout=ABORT_TIMEOUT,
               what="the oldest held set's age growing while the server is idle")
    nothing_held(prefill, timeout=ABORT_TIMEOUT + 20)
    assert time.monotonic() - held_at >= ABORT_TIMEOUT - 1
    wait_until(lambda: metric(prefill, "neuron_di_kv_blocks_held") == metric(
        prefill, "neuron_di_kv_held_oldest_seconds") == 0, timeout=10, what="no block held after the abort timeout")


def test_layout_mismatch_is_refused_at_handshake(stack: Stack) -> None:
    """Our own decode worker (its own pool layout) against vLLM's prefill: refused, both layouts named."""
    port = free_port()
    worker = Process("our-decode", ["-m", "worker", "--role", "decode", "--host", "127.0.0.1", "--port", str(port),
                                    "--threads", "1"])
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [worker], 60)
        uid = uuid.uuid4().hex   # as the proxy sends it: the leg's request id is X-Request-Id
        payload = {"model": "neuron-di-builtin", "prompt": "hello", "max_tokens": 4,
                   "kv_transfer_params": {"role": "decode", "request_id": uid,
                                          "remote_host": "127.0.0.1", "remote_port": stack.kv_ports["prefill"]}}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=payload, timeout=60.0,
                              headers={"X-Request-Id": uid})
        assert response.status_code >= 500
        message = response.json()["error"]["message"]
        assert "LKBTHD" in message and "LBHKTD" in message, message
    finally:
        worker.stop()


def test_prefill_killed_fails_requests_fast_and_decode_keeps_serving(stack: Stack) -> None:
    [prefill] = [p for p in stack.processes if p.name == "prefill"]
    decode = stack.worker_urls["decode"]
    os.killpg(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(timeout=30)

    started = time.monotonic()
    response = httpx.post(stack.url + "/v1/completions", json=body("/v1/completions", "hi", 8, False), timeout=60)
    assert response.status_code in (502, 503), response.text
    assert time.monotonic() - started < 10

    # A decode leg whose prefill peer is dead fails within the pull deadline, with a clear error.
    uid = uuid.uuid4().hex
    payload = {**body("/v1/completions", LONG_PROMPT, 8, False, temperature=0),
               "kv_transfer_params": {"role": "decode", "request_id": uid,
                                      "remote_host": "127.0.0.1", "remote_port": stack.kv_ports["prefill"]}}
    started = time.monotonic()
    response = httpx.post(decode + "/v1/completions", json=payload, timeout=60)
    elapsed = time.monotonic() - started
    assert response.status_code != 200 or response.json()["choices"][0]["finish_reason"] == "error", response.text
    assert elapsed < PULL_TIMEOUT + 10
    # vLLM's answer says nothing; its connector's status server says why, naming the prefill peer.
    [record] = httpx.get(f"{stack.status_urls['decode']}/timeline", params={"uid": uid}, timeout=10).json()["requests"]
    assert f"prefill peer 127.0.0.1:{stack.kv_ports['prefill']} " in record["error"], record
    nothing_held(decode)
    # ... and decode still serves.
    plain = httpx.post(decode + "/v1/completions", json=body("/v1/completions", "hello", 4, False), timeout=60)
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4
