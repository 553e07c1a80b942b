"""The Upstream interface over httpx, kept to compare clients in the proxy benchmark."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx

from common.openai_wire import json_bytes
from proxy.upstream import CUT_BEFORE_ANSWER, CUT_MID_ANSWER, Reply, Timeouts, in_words, json_headers, translated
from proxy.workers import WorkerRecord

_HTTPX_TIMEOUTS = (httpx.TimeoutException,)
_HTTPX_ERRORS = (httpx.HTTPError, OSError)


def _httpx_words(exc: BaseException) -> str:
    if isinstance(exc, httpx.RemoteProtocolError):  # httpx says which in its message only
        return CUT_MID_ANSWER if "incomplete" in str(exc) else CUT_BEFORE_ANSWER
    return in_words(exc)


class _HttpxStream:
    def __init__(self, response: httpx.Response, worker: WorkerRecord) -> None:
        self._response = response
        self._worker = worker
        self.status = response.status_code
        self.retry_after = response.headers.get("Retry-After")

    async def read(self) -> bytes:
        with translated(self._worker, _HTTPX_TIMEOUTS, _HTTPX_ERRORS, _httpx_words):
            return await self._response.aread()

    async def chunks(self) -> AsyncIterator[bytes]:
        with translated(self._worker, _HTTPX_TIMEOUTS, _HTTPX_ERRORS, _httpx_words):
            async for chunk in self._response.aiter_raw():
                yield chunk


class HttpxUpstream:
    """Upstream over one httpx.AsyncClient."""

    def __init__(self, worker: WorkerRecord, timeouts: Timeouts) -> None:
        self.worker = worker
        self._client = httpx.AsyncClient(
            base_url=worker.base_url,
            timeout=httpx.Timeout(timeouts.read, connect=timeouts.connect),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1000))

    async def post(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> Reply:
        with translated(self.worker, _HTTPX_TIMEOUTS, _HTTPX_ERRORS, _httpx_words):
            response = await self._client.post(path, content=json_bytes(payload), headers=json_headers(headers))
            return Reply(response.status_code, response.content, response.headers.get("Retry-After"))

    @asynccontextmanager
    async def stream(self, path: str, payload: dict[str, Any],
                     headers: dict[str, str]) -> AsyncIterator[_HttpxStream]:
        request = self._client.build_request("POST", path, content=json_bytes(payload), headers=json_headers(headers))
        with translated(self.worker, _HTTPX_TIMEOUTS, _HTTPX_ERRORS, _httpx_words):
            response = await self._client.send(request, stream=True)
        try:
            yield _HttpxStream(response, self.worker)
        finally:
            await response.aclose()

    async def get(self, path: str, timeout: float) -> Reply:
        with translated(self.worker, _HTTPX_TIMEOUTS, _HTTPX_ERRORS, _httpx_words):
            response = await self._client.get(path, timeout=timeout)
            return Reply(response.status_code, response.content)

    async def close(self) -> None:
        await self._client.aclose()
