"""A static proxy learns each worker's role and signal plane from the record the worker shows on GET /health.

Real `python -m worker` processes; the prefill worker's KV port is a free one, never the default.
"""
from __future__ import annotations

import json
from typing import Callable, Iterator

import httpx
import pytest

from stack.serving import free_port
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers, stop_together

PROMPT = "def fibonacci(n):\n    "
SAMPLING = {"model": "neuron-di-builtin", "max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[WorkerProcess, WorkerProcess, WorkerProcess]]:
    started: list[WorkerProcess] = []
    try:
        started = start_workers(*((role, "shm", ()) for role in ("prefill", "decode", "both")))
        yield started[0], started[1], started[2]
    finally:
        stop_together(*started)


def test_the_worker_shows_its_record_on_health(workers) -> None:
    prefill = workers[0]
    health = httpx.get(f"{prefill.url}/health", timeout=10).json()
    assert health == {"status": "ok", "draining": False, "worker": {
        "role": "prefill", "host": "127.0.0.1", "http_port": prefill.port, "kv_host": "127.0.0.1",
        "kv_port": prefill.kv_port, "engine_id": prefill.engine_id, "model": "neuron-di-builtin",
        "transfer": {"backend": "shm"}, "kv_protocol": "neuron", "status_port": 0, "server": "neuron-di",
        "kv_secret_id": "none", "dtype": "float32", "kv_events": ""}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_static_1p1d_without_prefill_kv_port_serves_as_one_worker(workers, servers: Callable[[Server], Server],
                                                                  stream: bool) -> None:
    prefill, decode, both = workers
    proxy = servers(start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                                 "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port)]))
    body = {"prompt": PROMPT, "stream": stream, **SAMPLING}
    through_proxy = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
    single = httpx.post(f"{both.url}/v1/completions", json=body, timeout=60)
    assert through_proxy.status_code == 200, through_proxy.text
    assert _text(through_proxy, stream) == _text(single, stream) != ""
    assert httpx.get(f"{proxy.url}/ready", timeout=10).status_code == 200


def test_a_wrong_prefill_kv_port_keeps_the_prefill_worker_out_and_fails_requests_at_once(
        workers, servers: Callable[[Server], Server]) -> None:
    prefill, decode, _ = workers
    wrong = free_port()
    proxy = servers(start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                                 "--prefill-kv-port", str(wrong),
                                 "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port)]))
    problem = (f"prefill worker 127.0.0.1:{prefill.port}: the command line gives KV port {wrong}, "
               f"but the worker's signal plane listens on port {prefill.kv_port}")
    ready = httpx.get(f"{proxy.url}/ready", timeout=10)
    assert ready.status_code == 503
    assert ready.json()["error"]["message"] == f"not ready: no healthy prefill worker; {problem}"
    # At once, not after the decode worker's 30 s pull timeout.
    reply = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": PROMPT, **SAMPLING}, timeout=10)
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == f"no healthy prefill worker is available; {problem}"
    assert f"{problem}; it stays out of rotation" in proxy.process.output()


def test_a_worker_of_the_other_role_is_named(workers, servers: Callable[[Server], Server]) -> None:
    prefill, decode, _ = workers
    proxy = servers(start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(decode.port),
                                 "--decode-ip", "127.0.0.1", "--decode-port", str(prefill.port)]))
    ready = httpx.get(f"{proxy.url}/ready", timeout=10)
    assert ready.status_code == 503
    assert ready.json()["error"]["message"] == (
        "not ready: no healthy prefill worker; no healthy decode worker; "
        f"decode worker 127.0.0.1:{prefill.port}: the worker there is a prefill worker; "
        f"prefill worker 127.0.0.1:{decode.port}: the worker there is a decode worker")


def _text(reply: httpx.Response, stream: bool) -> str:
    if not stream:
        return reply.json()["choices"][0]["text"]
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1])
