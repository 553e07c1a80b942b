"""Workers sharing a KV secret serve as before; a decode worker with a wrong secret, without one, or
facing a prefill worker without one is refused with an error naming the peer, and both sides say so;
a proxy in front of such workers is not ready, and a failed stream leaves no KV held."""
from __future__ import annotations

import asyncio
import json
from typing import Iterator

import httpx
import pytest

from tests.di.conftest import write_secret
from tests.di.workers import disaggregated
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers, stop_together

ABORT_TIMEOUT_S = 3
BODY = {"model": "neuron-di-builtin", "prompt": list(range(60, 130)), "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def workers(kv_secret_file: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    """Over tcp: prefill workers with the secret and without; decode workers with it, another one, none."""
    other = write_secret(tmp_path_factory.mktemp("other") / "secret", "another deployment's secret")
    specs = {"prefill": ("prefill", [kv_secret_file]), "open-prefill": ("prefill", []),
             "decode": ("decode", [kv_secret_file]), "wrong-decode": ("decode", [other]), "open-decode": ("decode", [])}
    started: dict[str, WorkerProcess] = {}
    try:
        started = dict(zip(specs, start_workers(*(
            (role, "tcp", ["--kv-abort-timeout", str(ABORT_TIMEOUT_S)] + (["--kv-secret-file", *secret] if secret else []))
            for role, secret in specs.values()))))
        yield started
    finally:
        stop_together(*started.values())


def run(prefill: WorkerProcess, decode: WorkerProcess) -> httpx.Response:
    async def both_legs() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            return await disaggregated(client, prefill, decode, "/v1/completions", BODY)
    p_response, d_response = asyncio.run(both_legs())
    assert p_response.status_code == 200, p_response.text
    return d_response


def refusal(response: httpx.Response) -> str:
    assert response.status_code == 500, response.text
    return response.json()["error"]["message"]


def test_the_same_secret_serves_exactly(workers: dict[str, WorkerProcess], both_worker: WorkerProcess) -> None:
    want = httpx.post(f"{both_worker.url}/v1/completions", json=BODY, timeout=60.0).json()["choices"]
    for _ in range(3):
        response = run(workers["prefill"], workers["decode"])
        assert response.status_code == 200 and response.json()["choices"] == want, response.text
    for name in ("prefill", "decode"):
        workers[name].wait_blocks_free()


def test_start_up_says_where_the_kv_plane_listens_and_whether_it_is_authenticated(workers) -> None:
    secured, open_ = workers["prefill"].proc.output(), workers["open-prefill"].proc.output()
    listens = f"KV plane listens on signal plane 127.0.0.1:{workers['prefill'].kv_port}, tcp 127.0.0.1:"
    assert listens in secured and "(loopback: reachable only from this host)" in secured
    assert "authenticated with the shared KV secret (HMAC; not encrypted)" in secured
    assert "NOT authenticated (no --kv-secret-file or NEURON_DI_KV_SECRET_FILE)" in open_
    # A decode worker's own signal plane is its hand-back plane, where the answers' KV it writes back waits
    # (write-back of chats under way is on by default): its record names that port, and it is authenticated too.
    decode = workers["decode"]
    port = httpx.get(f"{decode.url}/health", timeout=10).json()["worker"]["kv_port"]
    assert port > 0 and f"KV plane listens on signal plane 127.0.0.1:{port}, " in decode.proc.output()
    assert "authenticated with the shared KV secret" in decode.proc.output()


def test_a_wrong_secret_is_refused_and_logged_by_the_prefill(workers: dict[str, WorkerProcess]) -> None:
    prefill = workers["prefill"]
    message = refusal(run(prefill, workers["wrong-decode"]))
    assert f"prefill peer 127.0.0.1:{prefill.kv_port} refused our proof of the KV secret" in message, message
    assert "failed to prove the KV secret" in prefill.proc.output()
    for name in ("prefill", "wrong-decode"):
        workers[name].wait_blocks_free(timeout=ABORT_TIMEOUT_S + 20)


@pytest.mark.parametrize("prefill, decode, fragment", [
    ("prefill", "open-decode", "requires the KV secret, and this decode worker has none"),
    ("open-prefill", "decode", "runs without the KV secret this decode worker has"),
])
def test_a_secret_on_one_side_only_is_refused(workers: dict[str, WorkerProcess], prefill: str, decode: str,
                                              fragment: str) -> None:
    p = workers[prefill]
    message = refusal(run(p, workers[decode]))
    assert f"prefill peer 127.0.0.1:{p.kv_port} ({p.engine_id}) {fragment}" in message, message
    assert f"request {message.split(chr(39))[1]} failed: {message}" in workers[decode].proc.output()  # one line
    assert "Traceback" not in workers[decode].proc.output()
    wait_until(lambda: "refused decode engine" in p.proc.output(), timeout=10, what="the prefill side's log")
    for name in (prefill, decode):
        workers[name].wait_blocks_free(timeout=ABORT_TIMEOUT_S + 20)


@pytest.fixture(scope="module")
def proxy_open_decode(workers: dict[str, WorkerProcess]) -> Iterator[Server]:
    """The proxy in front of the prefill worker with the secret and the decode worker without one; the
    prefill leg answers before the decode leg starts, so a decode leg's failure always comes mid-stream."""
    proxy = start_proxy(["--prefill", f"127.0.0.1:{workers['prefill'].port}",
                         "--decode", f"127.0.0.1:{workers['open-decode'].port}",
                         "--disaggregation-strategy", "prefill_first"])
    try:
        yield proxy
    finally:
        proxy.process.stop()


def test_a_proxy_whose_workers_cannot_authenticate_is_not_ready_and_says_why(
        workers: dict[str, WorkerProcess], proxy_open_decode: Server) -> None:
    prefill, decode = workers["prefill"], workers["open-decode"]
    ready = httpx.get(f"{proxy_open_decode.url}/ready", timeout=10)
    assert ready.status_code == 503
    assert ready.json()["error"]["message"] == (
        f"not ready: decode worker 127.0.0.1:{decode.port} cannot authenticate to prefill worker "
        f"127.0.0.1:{prefill.port}: the prefill worker requires a KV secret and the decode worker has none "
        "(give every worker the same --kv-secret-file)")


def test_a_stream_whose_decode_leg_fails_frees_the_prefill_kv_at_once(
        workers: dict[str, WorkerProcess], proxy_open_decode: Server) -> None:
    prefill = workers["prefill"]
    for _ in range(3):
        with httpx.stream("POST", f"{proxy_open_decode.url}/v1/completions", json={**BODY, "stream": True},
                          timeout=60) as reply:
            events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert reply.status_code == 200 and events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert error["type"] == "kv_transfer_error" and "requires the KV secret" in error["message"], error
        # At once (the proxy aborts the request at the prefill worker), not after --kv-abort-timeout.
        wait_until(lambda: prefill.blocks_used() == 0, timeout=1.0, what="the prefill worker's KV freed")
