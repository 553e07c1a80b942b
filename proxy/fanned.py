"""Answering a request for several answers (proxy/fanout.py): its parts at once, their answers merged.

Every part is a request of its own through the forwarder. If one fails before the answer starts, the
others are cancelled and the client gets that failure's status; once streaming, an error event in
one part's stream ends the whole answer. Either way every part's legs are cancelled (a stream is
closed, which cancels its legs and tells its prefill worker to free the request).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Awaitable, Callable, Sequence

from common.openai_wire import json_bytes
from proxy.answers import Answer, JSONAnswer, StreamAnswer
from proxy.errors import UpstreamProtocol
from proxy.fanout import Part, StreamMerger, merged_body
from proxy.requests import ClientRequest

_QUEUE_EVENTS = 256  # events of all parts waiting for the client: a slow client slows the parts down


@dataclass(frozen=True, slots=True)
class _Started:
    """A part's stream, started (so that closing it runs its cleanup), with the events it gave so far."""

    head: list[bytes]
    events: AsyncGenerator[bytes, None]


async def answer_all(request: ClientRequest, parts: Sequence[Part],
                     answer: Callable[[ClientRequest], Awaitable[Answer]]) -> Answer:
    """The one answer to `request`, each of whose `parts` is answered by `answer`."""
    response_id = request.endpoint.id_prefix + uuid.uuid4().hex
    results = await _all([asyncio.ensure_future(_started(answer(part.request))) for part in parts])
    if not request.stream:
        bodies = [_json(result) for result in results]
        return JSONAnswer(json_bytes(merged_body(response_id, parts, bodies)))
    merger = StreamMerger(response_id, int(time.time()), parts, request.include_usage)
    return StreamAnswer(_merged(merger, [r for r in results if isinstance(r, _Started)]))


async def _started(answer: Awaitable[Answer]) -> JSONAnswer | _Started:
    got = await answer
    if isinstance(got, JSONAnswer):
        return got
    try:
        head = [await got.events.__anext__()]
    except StopAsyncIteration:
        head = []
    return _Started(head, got.events)


async def _all(tasks: list[asyncio.Future[Any]]) -> list[Any]:
    """Every task's result; the first failure (or our cancellation) cancels the rest and closes the streams
    already started."""
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, _Started):
                await result.events.aclose()
        raise


def _json(result: Any) -> dict[str, Any]:
    try:
        body = json.loads(result.body)
    except ValueError as exc:
        raise UpstreamProtocol(f"answer is not JSON: {result.body[:80]!r}") from exc
    if not isinstance(body, dict):
        raise UpstreamProtocol("answer is not a JSON object")
    return body


async def _merged(merger: StreamMerger, streams: list[_Started]) -> AsyncGenerator[bytes, None]:
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=_QUEUE_EVENTS)
    pumps: list[asyncio.Task[None]] = []
    try:
        for i, stream in enumerate(streams):
            for event in stream.head:
                for out in merger.feed(i, event):
                    yield out
        pumps = [asyncio.ensure_future(_pump(i, stream.events, queue)) for i, stream in enumerate(streams)]
        running = len(pumps)
        while running and not merger.failed:
            i, event = await queue.get()
            if event is None:
                running -= 1
            elif isinstance(event, BaseException):
                raise event
            else:
                for out in merger.feed(i, event):
                    yield out
        if not merger.failed:
            for out in merger.close():
                yield out
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await stream.events.aclose()


async def _pump(part: int, events: AsyncGenerator[bytes, None], queue: asyncio.Queue[tuple[int, Any]]) -> None:
    try:
        async for event in events:
            await queue.put((part, event))
    except Exception as exc:  # noqa: BLE001 - handed to the merged stream, which raises it
        await queue.put((part, exc))
        return
    await queue.put((part, None))
