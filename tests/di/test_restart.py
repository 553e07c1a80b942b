"""Workers that die are replaced; their peers reconnect; etcd forgets the dead."""
from __future__ import annotations


import httpx
import pytest

from tests.proxy.registration import registered_workers
from tests.di.workers import disaggregated
from tests.worker_process import WorkerProcess, start_workers, stop_together
from tests.helpers import wait_until

BODY = {"model": "neuron-di-builtin", "prompt": list(range(50, 90)), "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}


def one_request(prefill: WorkerProcess, decode: WorkerProcess) -> dict:
    import asyncio

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            return await disaggregated(client, prefill, decode, "/v1/completions", BODY)
    p, d = asyncio.run(run())
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    return d.json()["choices"]


@pytest.fixture(scope="module")
def want(both_worker: WorkerProcess) -> list:
    return httpx.post(f"{both_worker.url}/v1/completions", json=BODY, timeout=60.0).json()["choices"]


@pytest.mark.parametrize("victim, secured", [("prefill", False), pytest.param("decode", False, marks=pytest.mark.slow),
                                            ("decode", True)], ids=["prefill", "decode", "decode-same-id-and-secret"])
def test_restarted_worker_is_reconnected(victim: str, secured: bool, want: list, kv_secret_file: str) -> None:
    # Secured: a decode worker that comes back with its --engine-id gets it again (its old session is gone),
    # and both sides prove the KV secret anew.
    extra = ["--kv-secret-file", kv_secret_file] if secured else []
    prefill, decode = start_workers(("prefill", "tcp", extra),
                                    ("decode", "tcp", extra + (["--engine-id", "decode-kept"] if secured else [])))
    workers = {"prefill": prefill, "decode": decode}
    try:
        assert one_request(workers["prefill"], workers["decode"]) == want
        workers[victim].proc.kill()
        workers[victim] = workers[victim].restarted()
        assert one_request(workers["prefill"], workers["decode"]) == want
        for worker in workers.values():
            worker.wait_blocks_free()
    finally:
        stop_together(*workers.values())


def test_etcd_key_appears_and_vanishes_after_kill9(etcd_server) -> None:
    ttl = 2
    prefill = WorkerProcess("prefill", "tcp", ["--etcd", etcd_server.endpoint, "--etcd-ttl", str(ttl)])
    try:
        records = wait_until(lambda: registered_workers(etcd_server.endpoint, "prefill"), timeout=10)
        assert [(r.host, r.http_port, r.kv_port, r.model) for r in records] == [
            ("127.0.0.1", prefill.port, prefill.kv_port, "neuron-di-builtin")]
        prefill.proc.kill()
        wait_until(lambda: not registered_workers(etcd_server.endpoint, "prefill"), timeout=ttl + 5)
    finally:
        prefill.stop()


def test_etcd_key_is_revoked_on_clean_shutdown(etcd_server) -> None:
    decode = WorkerProcess("decode", "tcp", ["--etcd", etcd_server.endpoint, "--etcd-ttl", "30"])
    try:
        records = wait_until(lambda: registered_workers(etcd_server.endpoint, "decode"), timeout=10)
        assert records[0].http_port == decode.port
    finally:
        decode.stop()
    assert not registered_workers(etcd_server.endpoint, "decode")  # revoked, not left to expire
