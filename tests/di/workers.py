"""Test helpers: a prefill/decode worker pair, and both legs of a request sent as the proxy sends them."""
from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import httpx

from tests.worker_process import WorkerProcess, start_workers, stop_together


@contextmanager
def worker_pair(transport: str, prefill_extra: Sequence[str] = (),
                decode_extra: Sequence[str] = ()) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """A prefill and a decode worker (separate processes) over one transport, both always stopped."""
    prefill, decode = start_workers(("prefill", transport, prefill_extra), ("decode", transport, decode_extra))
    try:
        yield prefill, decode
    finally:
        stop_together(decode, prefill)


def prefill_body(body: dict[str, Any], uid: str) -> dict[str, Any]:
    """The prefill leg exactly as the proxy sends it."""
    return {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"role": "prefill", "request_id": uid}}


def decode_body(body: dict[str, Any], uid: str, prefill: WorkerProcess) -> dict[str, Any]:
    """The decode leg exactly as the proxy sends it."""
    return {**body, "kv_transfer_params": {"role": "decode", "request_id": uid, "remote_host": "127.0.0.1",
                                           "remote_port": prefill.kv_port,
                                           "remote_engine_id": prefill.engine_id}}


async def disaggregated(client: httpx.AsyncClient, prefill: WorkerProcess, decode: WorkerProcess, path: str,
                        body: dict[str, Any], uid: str | None = None) -> tuple[httpx.Response, httpx.Response]:
    """Sends both legs of one request at the same time, as the proxy does."""
    import asyncio

    uid = uid or uuid.uuid4().hex
    headers = {"X-Request-Id": uid}
    return await asyncio.gather(
        client.post(f"{prefill.url}{path}", json=prefill_body(body, uid), headers=headers),
        client.post(f"{decode.url}{path}", json=decode_body(body, uid, prefill), headers=headers))
