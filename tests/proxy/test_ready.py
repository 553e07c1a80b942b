"""GET /ready: 503 until every role the proxy needs has a healthy worker, while /health (liveness) is 200."""
from __future__ import annotations

from typing import Callable

import httpx

from stack.serving import free_port

from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_fake_worker, start_proxy


def _ready(proxy: Server) -> httpx.Response:
    assert httpx.get(f"{proxy.url}/health", timeout=5).status_code == 200  # alive throughout
    return httpx.get(f"{proxy.url}/ready", timeout=5)


def _not_ready(message: str) -> dict:
    return {"error": {"message": message, "type": "service_unavailable", "param": None, "code": 503}}


def test_a_proxy_started_before_its_workers_is_ready_once_each_role_has_a_healthy_one(
        servers: Callable[[Server], Server]) -> None:
    prefill_port, decode_port = free_port(), free_port()
    proxy = servers(start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill_port),
                                 "--decode-ip", "127.0.0.1", "--decode-port", str(decode_port),
                                 "--health-interval", "0.2"]))
    reply = _ready(proxy)
    assert reply.status_code == 503
    # Each missing worker is named, with why: nothing listens on its port yet.
    refused = "connection refused (nothing listens there: the worker is not started yet, or stopped?)"
    assert reply.json() == _not_ready(
        f"not ready: no healthy prefill worker; no healthy decode worker; decode worker 127.0.0.1:{decode_port}: "
        f"{refused}; prefill worker 127.0.0.1:{prefill_port}: {refused}")

    servers(start_fake_worker("prefill", port=prefill_port))
    wait_until(lambda: _ready(proxy).json() == _not_ready(
        f"not ready: no healthy decode worker; decode worker 127.0.0.1:{decode_port}: {refused}"),
               timeout=20, what="only decode missing")
    servers(start_fake_worker("decode", port=decode_port))
    wait_until(lambda: _ready(proxy).status_code == 200, timeout=20, what="ready")
    # Up for the first time: news, not a recovery.
    assert f"INFO proxy.discovery: decode worker 127.0.0.1:{decode_port} is healthy\n" in proxy.process.output()
    assert "healthy again" not in proxy.process.output()
    assert _ready(proxy).json() == {"status": "ready", "workers": {"both": {"known": 0, "healthy": 0},
                                                           "prefill": {"known": 1, "healthy": 1},
                                                           "decode": {"known": 1, "healthy": 1}}}
    answer = httpx.post(f"{proxy.url}/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 3},
                        timeout=30)
    assert answer.status_code == 200, answer.text


def test_a_colocated_proxy_needs_a_healthy_both_worker(servers: Callable[[Server], Server]) -> None:
    port = free_port()
    proxy = servers(start_proxy(["--mode", "colocated", "--worker", f"127.0.0.1:{port}", "--health-interval", "0.2"]))
    # Polled: until the first health check the answer cannot name why the worker is out of rotation.
    expected = _not_ready(f"not ready: no healthy both worker; both worker 127.0.0.1:{port}: connection "
                          "refused (nothing listens there: the worker is not started yet, or stopped?)")
    wait_until(lambda: _ready(proxy).status_code == 503 and _ready(proxy).json() == expected, timeout=20,
               what="a 503 naming the refused connection")
    servers(start_fake_worker("both", port=port))
    wait_until(lambda: _ready(proxy).status_code == 200, timeout=20, what="ready")
