"""POST /role: a running worker changes role between prefill and decode, keeping its process and model.

Simulated workers (`--engine mock`, real HTTP, etcd, signal plane and KV transfers) 1P2D behind the proxy:
one decode worker becomes a prefill worker while a load runs, and every request succeeds with the
answer of one mock `both` worker; the worker's etcd record moves to the new role, GET /health tells how
the change went, and bad requests are refused with clear errors.
"""
from __future__ import annotations

import asyncio
from typing import Iterator

import httpx
import pytest

from faults.load import Load, LoadSize, Tally, body, prompts
from stack.etcd import EtcdServer
from stack.serving import Process, free_port, wait_healthy
from stack.worker_metrics import wait_blocks_free
from tests.helpers import wait_until
from tests.proxy.registration import registered_workers

# The planner's real-process test (tests/planner/test_role_flip_stack.py) flips a worker under load by
# default; these run with --full.
pytestmark = pytest.mark.slow
MOCK = ["--engine", "mock", "--threads", "1", "--kv-transport", "shm", "--mock-decode-base-ms", "20",
        "--drain-timeout", "30", "--etcd-ttl", "3"]


def _worker(role: str, etcd: str | None) -> tuple[Process, str]:
    port = free_port()
    args = ["-m", "worker", "--role", role, "--port", str(port), "--kv-port", str(free_port()), *MOCK]
    return Process(f"mock-{role}", args + (["--etcd", etcd] if etcd else [])), f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, str, dict[str, str], str]]:
    """(proxy URL, `both` URL, {name: worker URL}, etcd endpoint): mock prefill, decode-0, decode-1."""
    etcd = EtcdServer()
    processes: list[Process] = []
    urls: dict[str, str] = {}
    try:
        for name, role in (("prefill", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"),
                           ("both", "both")):
            process, urls[name] = _worker(role, None if role == "both" else etcd.endpoint)
            processes.append(process)
        for url in urls.values():
            wait_healthy(f"{url}/health", processes, 120)
        port = free_port()
        processes.append(Process("proxy", ["proxy_server.py", "--port", str(port), "--etcd", etcd.endpoint,
                                           "--health-interval", "0.5"]))
        proxy = f"http://127.0.0.1:{port}"
        wait_healthy(f"{proxy}/ready", processes, 60)
        yield proxy, urls.pop("both"), urls, etcd.endpoint
    finally:
        for process in reversed(processes):
            process.stop()
        etcd.stop()


async def _answers(url: str, requests: list) -> list[str]:
    """The mock `both` worker's answers, asked concurrently."""
    async with httpx.AsyncClient(timeout=60) as client:
        replies = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body(r, False)) for r in requests))
    return [reply.json()["choices"][0]["text"] for reply in replies]


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


@pytest.mark.parametrize("payload, status, message", [
    ({"role": "encode"}, 400, "`role` must be one of ['prefill', 'decode']"),
    ({}, 400, "`role` must be one of"),
    ({"role": "decode"}, 200, None),
])
def test_bad_or_idle_role_changes(stack: tuple, payload: dict, status: int, message: str | None) -> None:
    _, _, workers, _ = stack
    reply = httpx.post(f"{workers['decode-1']}/role", json=payload, timeout=10)
    assert reply.status_code == status
    if message:
        assert message in reply.json()["error"]["message"] and reply.json()["error"]["param"] == "role"
    else:
        assert reply.json() == {"status": "unchanged", "role": "decode"}


def test_a_both_worker_does_not_change_role(stack: tuple) -> None:
    _, both, _, _ = stack
    reply = httpx.post(f"{both}/role", json={"role": "prefill"}, timeout=10)
    assert reply.status_code == 400 and "only prefill and decode workers change role" in reply.text


def test_a_decode_worker_becomes_a_prefill_worker_under_load(stack: tuple) -> None:
    proxy, both, workers, etcd = stack
    flipped = workers["decode-1"]
    engine_id = _health(flipped)["worker"]["engine_id"]
    requests = prompts(32, seed=11, input_len=(20, 400), output_len=(8, 40))
    load = Load(proxy, requests, LoadSize(len(requests), 6))

    async def run() -> None:
        running = asyncio.ensure_future(load.run())
        await load.wait_done(8, timeout_s=60)
        reply = await asyncio.to_thread(httpx.post, f"{flipped}/role", json={"role": "prefill"}, timeout=10)
        assert reply.status_code == 202 and reply.json() == {"status": "changing_role", "from": "decode",
                                                             "to": "prefill"}
        again = await asyncio.to_thread(httpx.post, f"{flipped}/role", json={"role": "prefill"}, timeout=10)
        assert again.status_code in (409, 200)   # 409 while it changes, unchanged once done
        await asyncio.to_thread(wait_until, lambda: _health(flipped)["worker"]["role"] == "prefill"
                                and not _health(flipped)["draining"], timeout=60, what="the flip")
        await running
    asyncio.run(run())
    health = _health(flipped)
    assert health["last_role_change"]["ok"] and health["last_role_change"]["to"] == "prefill"
    assert health["worker"]["engine_id"] == engine_id   # the same process, its model still loaded
    roles = sorted((r.role, r.http_port) for r in registered_workers(etcd))
    assert [role for role, _ in roles] == ["decode", "prefill", "prefill"]
    # The flipped worker now prefills: more requests through the proxy, some on it.
    more = prompts(12, seed=12, input_len=(20, 200), output_len=(4, 16))
    second = Load(proxy, more, LoadSize(len(more), 4))
    asyncio.run(second.run())
    tally = Tally()
    for outcome, want in zip(load.outcomes + second.outcomes, asyncio.run(_answers(both, requests + more))):
        tally.add(outcome, want)   # type: ignore[arg-type]
    assert tally.ok == len(requests) + len(more), (tally.problems, tally.errors)
    assert not any(wait_blocks_free(workers, 30).values())
    httpx.post(f"{flipped}/role", json={"role": "decode"}, timeout=10)   # back, for the other tests
    wait_until(lambda: _health(flipped)["worker"]["role"] == "decode" and not _health(flipped)["draining"], timeout=60)
