"""One HTTP request's choices served together: n per prompt, each its own engine request, merged
into one response (a whole body, or SSE chunks of every choice as they come).

Leaving early (the client went away, one choice failed) aborts every choice's engine request.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from common.openai_wire import DONE_EVENT, sse_event
from worker.engine.request import RequestOutput
from worker.server.async_engine import RequestStream
from worker.server.choice import Choice, merged
from worker.server.metrics import RequestTimer
from worker.server.responses import ChoiceBody, ResponseShape, continuous_usage, usage


@dataclass
class Part:
    """One choice's engine request: what it shows, its outputs, its latency bookkeeping."""

    choice: Choice
    stream: RequestStream
    timer: RequestTimer
    prompt_index: int
    num_prompt_tokens: int
    first: RequestOutput | None = None   # a decode leg's first output, awaited before the headers went out


def total_usage(parts: list[Part], details: bool = True) -> dict[str, Any]:
    """Summed usage: each prompt's tokens once, every choice's tokens (vLLM's rule)."""
    prompts = {p.prompt_index: p.num_prompt_tokens for p in parts}
    return usage(sum(prompts.values()), sum(p.choice.num_tokens for p in parts), details)


async def collect(shape: ResponseShape, parts: list[Part]) -> tuple[dict[str, Any], str | None]:
    """The whole body of a non-streamed response, and the finish reason of its last choice."""
    bodies: dict[int, list[ChoiceBody]] = {p.choice.spec.index: [] for p in parts}
    async for part, out in merge(parts):
        part.timer.tokens(len(out.new_token_ids), out.finished)
        bodies[part.choice.spec.index].append(part.choice.step(out))
    choices = [merged(bodies[p.choice.spec.index], p.choice.prompt_logprobs_body() if shape.kind == "completion"
                      else None) for p in parts]
    chat_prompt_logprobs = parts[0].choice.prompt_logprobs_body() if shape.kind == "chat" else None
    return shape.full(choices, total_usage(parts), chat_prompt_logprobs), parts[-1].choice.finish_reason


async def events(shape: ResponseShape, parts: list[Part], include_usage: bool, continuous: bool,
                 on_error: Callable[[BaseException], dict[str, Any]]) -> AsyncIterator[bytes]:
    """The SSE events of a streamed response: chat's role chunks, one chunk per token of any choice, the
    usage chunk if asked for, `[DONE]`. A failure once the headers went out is an error event, then `[DONE]`."""
    def chunk(part: Part, body: dict[str, Any]) -> bytes:
        if continuous:   # right after the choices, where vLLM puts it
            stats = continuous_usage(shape.kind, part.num_prompt_tokens, part.choice.num_tokens)
            keys = list(body)
            body = {**{k: body[k] for k in keys[:keys.index("choices") + 1]}, "usage": stats, **body}
        return sse_event(body)

    if shape.kind == "chat":
        for part in parts:
            yield chunk(part, shape.role_chunk(part.choice.spec.index))
    try:
        async for part, out in merge(parts):
            part.timer.tokens(len(out.new_token_ids), out.finished)
            body = part.choice.step(out)
            # One chunk per token, even when its text is held back (part of a UTF-8 character, a possible
            # stop string): the DI proxy and ITL counting rely on it.
            if out.new_token_ids or out.finished:
                yield chunk(part, shape.chunk(body))
    except Exception as exc:  # headers are sent: the error travels as an event (as vLLM does)
        yield sse_event(on_error(exc))
        yield DONE_EVENT
        return
    if include_usage:
        yield sse_event(shape.usage_chunk(total_usage(parts, details=False)))
    yield DONE_EVENT


async def merge(parts: list[Part]) -> AsyncIterator[tuple[Part, RequestOutput]]:
    """Every part's outputs, each part's in order, as they come; leaving early aborts every part."""
    async with contextlib.AsyncExitStack() as streams:
        for part in parts:
            await streams.enter_async_context(part.stream)   # leaving aborts it (unless it ended)
        if len(parts) == 1:
            async for out in _outputs(parts[0]):
                yield parts[0], out
            return
        queue: asyncio.Queue[tuple[Part, RequestOutput] | BaseException | None] = asyncio.Queue()
        tasks = [asyncio.ensure_future(_feed(part, queue)) for part in parts]
        try:
            remaining = len(parts)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()


async def _feed(part: Part, queue: asyncio.Queue[tuple[Part, RequestOutput] | BaseException | None]) -> None:
    try:
        async for out in _outputs(part):
            queue.put_nowait((part, out))
    except Exception as exc:   # the merge raises it (and aborts every part)
        queue.put_nowait(exc)
        return
    queue.put_nowait(None)


async def _outputs(part: Part) -> AsyncIterator[RequestOutput]:
    if part.first is not None:
        yield part.first
    async for out in part.stream:
        yield out
