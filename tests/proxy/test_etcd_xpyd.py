"""Dynamic xPyD: fake workers register in a real etcd; the proxy follows them without restarting."""
from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Callable

import httpx

from stack.etcd import EtcdServer

from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_fake_worker, start_proxy


def _workers(proxy: Server) -> dict[str, dict[str, int]]:
    return httpx.get(f"{proxy.url}/health", timeout=5).json()["workers"]


def _wait_workers(proxy: Server, role: str, known: int, healthy: int) -> None:
    wait_until(lambda: _workers(proxy)[role] == {"known": known, "healthy": healthy}, timeout=20,
               what=f"{known} known / {healthy} healthy {role} workers")


def _send(proxy: Server, count: int, stream: bool = False) -> None:
    """`count` requests, every one of which must succeed with the whole answer."""
    with httpx.Client(timeout=30) as client:
        for i in range(count):
            body = {"model": "fake-model", "prompt": f"request {i}", "max_tokens": 3, "stream": stream}
            reply = client.post(f"{proxy.url}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            if stream:
                assert reply.text.count(" w") == 3 and reply.text.endswith("data: [DONE]\n\n")
            else:
                assert reply.json()["choices"][0]["text"].count(" w") == 3


def _legs(servers: list[Server]) -> Counter[int]:
    return Counter({s.port: len(s.state()["legs"]) for s in servers})


def test_2p2d_spread_kill_and_join(etcd_server: EtcdServer, servers: Callable[[Server], Server]) -> None:
    proxy = servers(start_proxy(["--etcd", etcd_server.endpoint, "--health-interval", "0.5"]))
    empty = httpx.post(f"{proxy.url}/v1/completions", json={"model": "fake-model", "prompt": "x"}, timeout=10)
    assert empty.status_code == 503
    assert empty.json()["error"]["message"] == "no healthy prefill worker is available"
    assert httpx.get(f"{proxy.url}/v1/models", timeout=10).status_code == 503

    prefills = [servers(start_fake_worker("prefill", etcd_server.endpoint)) for _ in range(2)]
    decodes = [servers(start_fake_worker("decode", etcd_server.endpoint)) for _ in range(2)]
    _wait_workers(proxy, "prefill", 2, 2)
    _wait_workers(proxy, "decode", 2, 2)
    assert [m["id"] for m in httpx.get(f"{proxy.url}/v1/models", timeout=10).json()["data"]] == ["fake-model"]
    _send(proxy, 20)
    assert sorted(_legs(prefills).values()) == [10, 10]
    assert sorted(_legs(decodes).values()) == [10, 10]

    dead, survivor = decodes
    dead.process.kill()
    _wait_workers(proxy, "decode", 1, 1)  # its lease expired: the key is gone from etcd
    before = _legs([survivor])[survivor.port]
    _send(proxy, 10)
    _send(proxy, 4, stream=True)
    assert _legs([survivor])[survivor.port] == before + 14

    newcomer = servers(start_fake_worker("decode", etcd_server.endpoint))
    _wait_workers(proxy, "decode", 2, 2)
    _send(proxy, 10)
    assert len(newcomer.state()["legs"]) == 5


def test_failed_health_check_leaves_rotation_until_it_passes(
        etcd_server: EtcdServer, servers: Callable[[Server], Server]) -> None:
    proxy = servers(start_proxy(["--etcd", etcd_server.endpoint, "--health-interval", "0.5"]))
    # A long lease: the frozen worker stays registered, so only its health check can remove it.
    frozen, other = (servers(start_fake_worker("prefill", etcd_server.endpoint, lease_ttl=60)) for _ in range(2))
    servers(start_fake_worker("decode", etcd_server.endpoint))
    _wait_workers(proxy, "prefill", 2, 2)
    os.kill(frozen.process.pid, signal.SIGSTOP)  # alive and registered, but not answering
    try:
        _wait_workers(proxy, "prefill", 2, 1)
        before = len(other.state()["legs"])
        _send(proxy, 6)
        assert len(other.state()["legs"]) == before + 6
    finally:
        os.kill(frozen.process.pid, signal.SIGCONT)
    _wait_workers(proxy, "prefill", 2, 2)
    before = len(frozen.state()["legs"])
    _send(proxy, 4)
    assert len(frozen.state()["legs"]) == before + 2


def test_etcd_loss_keeps_the_last_known_workers(etcd_server: EtcdServer,
                                                servers: Callable[[Server], Server]) -> None:
    proxy = servers(start_proxy(["--etcd", etcd_server.endpoint, "--health-interval", "0.5"]))
    servers(start_fake_worker("prefill", etcd_server.endpoint))
    servers(start_fake_worker("decode", etcd_server.endpoint))
    _wait_workers(proxy, "decode", 1, 1)
    etcd_server.process.kill()
    wait_until(lambda: "keeping 2 known workers" in proxy.process.output(), timeout=20,
               what="the proxy noticing etcd is gone")
    _send(proxy, 5)
    assert _workers(proxy)["prefill"] == {"known": 1, "healthy": 1}
