"""decode_first on a `vllm serve` decode worker: the prefill legs its connector sends itself.

The proxy's decode_first flow calls the decode worker alone, naming the prefill worker's HTTP API
(`remote_url`). The scheduler side turns such a leg into a RemotePrefill order (the prompt's token
ids, one token); the worker side posts it from a small thread pool while its pull of the same
request retries `lookup_all` until the prefill worker has the KV. Only a failure matters here: a
prefill leg that does not answer 200 fails the pull, with a message naming the prefill worker.
"""
from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import httpx

from neuron_connector.vllm.orders import RemotePrefill

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0


class PrefillCalls:
    """Posts prefill legs; `on_failure(uid, message)` (from a pool thread) for each that fails."""

    def __init__(self, on_failure: Callable[[str, str], None], timeout_s: float, workers: int = 4) -> None:
        self._on_failure = on_failure
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kv-remote-prefill")
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))

    def send(self, order: RemotePrefill) -> None:
        self._pool.submit(self._call, order)

    def _call(self, order: RemotePrefill) -> None:
        where = f"prefill worker {order.url}"
        try:
            reply = self._client.post(f"{order.url}/v1/completions", json=order.body,
                                      headers={"X-Request-Id": order.uid})
        except httpx.HTTPError as exc:
            self._failed(order.uid, f"the prefill leg of request {order.uid!r} to {where} failed: "
                                    f"{type(exc).__name__}: {exc or 'the connection was lost'}")
            return
        if reply.status_code != 200:
            self._failed(order.uid, f"the prefill leg of request {order.uid!r} to {where} answered HTTP "
                                    f"{reply.status_code}: {_message(reply.content)}")

    def _failed(self, uid: str, message: str) -> None:
        try:
            self._on_failure(uid, message)
        except Exception:  # noqa: BLE001 - a callback must not kill the pool thread
            log.exception("reporting the failed prefill leg of %s raised", uid)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def _message(body: bytes) -> str:
    """The message of an OpenAI error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return repr(body[:200])
