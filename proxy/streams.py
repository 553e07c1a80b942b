"""A streamed answer as the client gets it: a disaggregated request's two legs stitched, or one leg
relayed; each ends with one [DONE], or with an error event and [DONE] once streaming has begun."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncGenerator, Callable

from common.openai_wire import DONE, DONE_EVENT, error_body, sse_event
from proxy.errors import ProxyError, to_http
from proxy.flows import DecodeLeg
from proxy.sse import encode_raw
from proxy.stitch import StreamStitcher
from proxy.stream_moves import StreamMover
from proxy.timing import AnswerTimer
from proxy.workers import WorkerRecord

END = object()  # marks the normal end of a streamed leg in its queue


async def stitched(stitcher: StreamStitcher, first: list[bytes], leg: DecodeLeg | None, timer: AnswerTimer,
                   first_token: Callable[[WorkerRecord, bool], None],
                   abandon: Callable[[], None], mover: StreamMover | None = None) -> AsyncGenerator[bytes, None]:
    """Prefill's events (`first`), then decode's through `stitcher`; `first_token(decode, matched)` is told
    whether decode's copy of the first token equals prefill's, as soon as it is known; `abandon()` when the
    answer fails after it began (a failed decode leg may never have released prefill's KV). With a `mover`, a
    lost decode leg is replaced by one on another worker that goes on from the tokens so far."""
    error: str | None = None
    try:
        if stitcher.prefill_token:
            timer.tick()
        for event in first:
            yield event
        if leg is None or leg.queue is None or stitcher.finished:
            return  # prefill's token ended the answer
        checked = False
        while (item := await leg.queue.get()) is not END:
            if mover is not None and (why := mover.why_lost(item)) is not None:
                if stitcher.finished:
                    break  # lost after its last token: nothing to move
                leg = mover.move(leg, why, stitcher, item if isinstance(item, BaseException) else None)
                if mover.moves == 1:
                    abandon()  # a lost leg may not have pulled or released prefill's KV; the new one recomputes it
                continue
            if isinstance(item, BaseException):
                raise item
            if mover is not None and (item := mover.observe(item)) is None:
                continue
            events = stitcher.feed(item)
            if events:
                timer.tick()
            for event in events:
                yield event
            if not checked and stitcher.first_token_matched is not None:
                checked = True  # counted at once, before the client can see the end of the answer
                first_token(leg.worker, stitcher.first_token_matched)
        for event in stitcher.close():
            yield event
    except ProxyError as exc:
        error = str(exc)
        abandon()
        yield error_event(exc)
    finally:
        cancel_leg(leg)  # client gone or answer failed: drop the decode connection
        timer.done(error)


async def relayed(first: Any, queue: asyncio.Queue[Any], task: asyncio.Task[None],
                  timer: AnswerTimer) -> AsyncGenerator[bytes, None]:
    """A single leg's stream, passed on event by event with one [DONE] at the end."""
    item, error = first, None
    try:
        while item is not END:
            if isinstance(item, BaseException):
                raise item
            if item != DONE:
                timer.tick()
                yield encode_raw(item)
            item = await queue.get()
        yield DONE_EVENT
    except ProxyError as exc:
        error = str(exc)
        yield error_event(exc)
    finally:
        task.cancel()
        timer.done(error)


def cancel_leg(leg: DecodeLeg | None) -> None:
    if leg is not None:
        leg.task.cancel()


def error_event(exc: ProxyError) -> bytes:
    """After streaming has started the status is sent: the error goes in an SSE event."""
    status, body, _ = to_http(exc)  # no headers: they are sent already
    try:
        payload = json.loads(body)
    except ValueError:  # a worker's own error body need not be JSON
        payload = error_body(status, str(exc), "upstream_error")
    # Re-encoded, not passed on: the body may span lines, an SSE data line must not.
    return sse_event(payload) + DONE_EVENT
