"""HTTP to one worker: the small interface the proxy uses, and its aiohttp implementation.

One client per worker for the life of the app, pooled keep-alive connections, a timeout
on connect and on every read (never on the whole answer: decode streams can be long).
Every foreign error is translated here into the UpstreamError tree.
"""
from __future__ import annotations

import asyncio
import errno
import json
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Protocol

import aiohttp

from common.openai_wire import json_bytes
from proxy.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from proxy.workers import WorkerRecord


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds allowed to connect to a worker, and between two reads of its answer."""

    connect: float = 5.0
    read: float = 600.0


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    retry_after: str | None = None  # the Retry-After header of an error answer

    def json(self) -> Any:
        return json.loads(self.body)


class StreamReply(Protocol):
    status: int
    retry_after: str | None

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...


class Upstream(Protocol):
    """What the proxy needs from an HTTP client to one worker."""

    worker: WorkerRecord

    async def post(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> Reply: ...

    def stream(self, path: str, payload: dict[str, Any],
               headers: dict[str, str]) -> AbstractAsyncContextManager[StreamReply]: ...

    async def get(self, path: str, timeout: float) -> Reply: ...

    async def close(self) -> None: ...


CUT_MID_ANSWER = "closed the connection in the middle of its answer (the worker stopped or crashed?)"
CUT_BEFORE_ANSWER = "closed the connection before answering (the worker stopped or crashed?)"
REFUSED = "connection refused (nothing listens there: the worker is not started yet, or stopped?)"


def in_words(exc: BaseException, cut_mid_answer: tuple[type[BaseException], ...] = (),
             cut_before_answer: tuple[type[BaseException], ...] = ()) -> str:
    """What a client library's connection error means, in the stack's words (not the library's class names)."""
    if isinstance(exc, cut_mid_answer):
        return CUT_MID_ANSWER
    if isinstance(exc, cut_before_answer):
        return CUT_BEFORE_ANSWER
    seen: BaseException | None = exc
    while seen is not None:  # the OS error under the library's own
        if isinstance(seen, OSError) and seen.errno == errno.ECONNREFUSED:
            return REFUSED
        if isinstance(seen, OSError) and seen.errno is not None and seen.strerror:
            return f"connection error: {seen.strerror}"
        seen = seen.__cause__ or seen.__context__
    return f"connection error: {exc}" if str(exc) else f"connection error ({type(exc).__name__})"


def _aiohttp_words(exc: BaseException) -> str:
    return in_words(exc, (aiohttp.ClientPayloadError,), (aiohttp.ServerDisconnectedError,))


@contextmanager
def translated(worker: WorkerRecord, timeout_types: tuple[type[BaseException], ...],
               error_types: tuple[type[BaseException], ...],
               words: Callable[[BaseException], str] = in_words) -> Iterator[None]:
    """Turns a client library's errors into UpstreamError, naming the worker and saying what happened."""
    try:
        yield
    except UpstreamError:
        raise
    except timeout_types as exc:
        raise UpstreamTimeout(f"timed out ({type(exc).__name__})", worker.role, worker.address) from exc
    except error_types as exc:
        said = words(exc)
        raise UpstreamUnavailable(said, worker.role, worker.address, refused=said == REFUSED) from exc


# A pooled connection idle this long is closed, not reused: workers close idle ones after 5 s (vLLM's uvicorn, our
# hypercorn), and a request written into a connection the worker is closing fails ("Can not write request body").
IDLE_REUSE_S = 2.0
_AIOHTTP_TIMEOUTS = (asyncio.TimeoutError, aiohttp.ServerTimeoutError)
_AIOHTTP_ERRORS = (aiohttp.ClientError, OSError)


class _AiohttpStream:
    def __init__(self, response: aiohttp.ClientResponse, worker: WorkerRecord) -> None:
        self._response = response
        self._worker = worker
        self.status = response.status
        self.retry_after = response.headers.get("Retry-After")

    async def read(self) -> bytes:
        with translated(self._worker, _AIOHTTP_TIMEOUTS, _AIOHTTP_ERRORS, _aiohttp_words):
            return await self._response.read()

    async def chunks(self) -> AsyncIterator[bytes]:
        with translated(self._worker, _AIOHTTP_TIMEOUTS, _AIOHTTP_ERRORS, _aiohttp_words):
            async for chunk in self._response.content.iter_any():
                yield chunk


class AiohttpUpstream:
    """Upstream over one aiohttp session; create it inside the running event loop."""

    def __init__(self, worker: WorkerRecord, timeouts: Timeouts) -> None:
        self.worker = worker
        self._session = aiohttp.ClientSession(
            base_url=worker.base_url, auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True, keepalive_timeout=IDLE_REUSE_S),
            timeout=aiohttp.ClientTimeout(total=None, connect=timeouts.connect, sock_read=timeouts.read))

    async def post(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> Reply:
        with translated(self.worker, _AIOHTTP_TIMEOUTS, _AIOHTTP_ERRORS, _aiohttp_words):
            async with self._session.post(path, data=json_bytes(payload), headers=json_headers(headers)) as response:
                return Reply(response.status, await response.read(), response.headers.get("Retry-After"))

    @asynccontextmanager
    async def stream(self, path: str, payload: dict[str, Any],
                     headers: dict[str, str]) -> AsyncIterator[_AiohttpStream]:
        with translated(self.worker, _AIOHTTP_TIMEOUTS, _AIOHTTP_ERRORS, _aiohttp_words):
            response = await self._session.post(path, data=json_bytes(payload), headers=json_headers(headers))
        try:
            yield _AiohttpStream(response, self.worker)
        finally:
            # An unfinished answer must drop the connection so the worker sees us leave.
            response.close()

    async def get(self, path: str, timeout: float) -> Reply:
        with translated(self.worker, _AIOHTTP_TIMEOUTS, _AIOHTTP_ERRORS, _aiohttp_words):
            async with self._session.get(path, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                return Reply(response.status, await response.read())

    async def close(self) -> None:
        await self._session.close()


def json_headers(headers: dict[str, str]) -> dict[str, str]:
    return {"Content-Type": "application/json", **headers}
