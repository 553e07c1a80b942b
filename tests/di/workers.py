"""Test helpers: prefill/decode/both worker processes on free ports, requests, KV-block scraping."""
from __future__ import annotations

import re
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import httpx

from tests.helpers import ManagedProcess, free_port, python_process, wait_http_ok, wait_until

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Worker:
    """`python -m worker --role ROLE` on free ports; `stop()` kills it and its children."""

    def __init__(self, role: str, transport: str = "shm", extra: Sequence[str] = (),
                 port: int | None = None, kv_port: int | None = None) -> None:
        self.role, self.transport, self.extra = role, transport, tuple(extra)
        self.port = port or free_port()
        self.kv_port = kv_port if kv_port is not None else (free_port() if role == "prefill" else 0)
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["-m", "worker", "--role", role, "--port", str(self.port), "--threads", "1",
                "--kv-transport", transport, "--kv-port", str(self.kv_port), *extra]
        self.proc: ManagedProcess = python_process(args, name=f"{role}-worker", env=WORKER_ENV)
        try:
            wait_http_ok(f"{self.url}/health", self.proc, timeout=120.0)
        except BaseException:
            self.proc.stop()
            raise

    def metric(self, name: str) -> int:
        """A gauge of this worker, read from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        assert match is not None, text
        return int(float(match.group(1)))

    def blocks_used(self) -> int:
        return self.metric("neuron_di_kv_blocks_used")

    def wait_blocks_free(self, timeout: float = 30.0) -> None:
        wait_until(lambda: self.blocks_used() == 0, timeout=timeout)

    def restarted(self) -> Worker:
        """The same worker (role, ports, flags) started anew; call after this one died."""
        return Worker(self.role, self.transport, self.extra, self.port, self.kv_port)

    def stop(self) -> None:
        self.proc.stop()


@contextmanager
def worker_pair(transport: str, prefill_extra: Sequence[str] = (),
                decode_extra: Sequence[str] = ()) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode worker (separate processes) over one transport, both always stopped."""
    prefill = Worker("prefill", transport, prefill_extra)
    try:
        decode = Worker("decode", transport, decode_extra)
    except BaseException:
        prefill.stop()
        raise
    try:
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def prefill_body(body: dict[str, Any], uid: str) -> dict[str, Any]:
    """The prefill leg exactly as the proxy sends it."""
    return {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"role": "prefill", "request_id": uid}}


def decode_body(body: dict[str, Any], uid: str, prefill: Worker) -> dict[str, Any]:
    """The decode leg exactly as the proxy sends it."""
    return {**body, "kv_transfer_params": {"role": "decode", "request_id": uid, "remote_host": "127.0.0.1",
                                           "remote_port": prefill.kv_port,
                                           "remote_engine_id": f"127.0.0.1:{prefill.port}"}}


async def disaggregated(client: httpx.AsyncClient, prefill: Worker, decode: Worker, path: str,
                        body: dict[str, Any], uid: str | None = None) -> tuple[httpx.Response, httpx.Response]:
    """Sends both legs of one request at the same time, as the proxy does."""
    import asyncio

    uid = uid or uuid.uuid4().hex
    headers = {"X-Request-Id": uid}
    return await asyncio.gather(
        client.post(f"{prefill.url}{path}", json=prefill_body(body, uid), headers=headers),
        client.post(f"{decode.url}{path}", json=decode_body(body, uid, prefill), headers=headers))
