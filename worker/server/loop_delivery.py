"""Handing results from the engine thread to asyncio event loops on other threads."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from worker.engine.request import RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sink:
    """Where one request's outputs go: a queue owned by an event loop on another thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


def deliver(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    """Runs `callback` on `loop`'s thread; a loop already closed has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        logger.debug("event loop closed; dropped a delivery")


def deliver_all(items: Iterable[tuple[Sink, RequestOutput | BaseException]]) -> None:
    """Puts each item on its sink's queue, in order, waking each event loop once (not once per item)."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput | BaseException]]] = {}
    for sink, item in items:
        batches.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in batches.items():
        deliver(loop, _put_each, batch)


def _put_each(batch: list[tuple[Sink, RequestOutput | BaseException]]) -> None:
    for sink, item in batch:
        sink.queue.put_nowait(item)


def settle(future: asyncio.Future[Any], outcome: Any) -> None:
    """Sets `future`'s result, or its exception when `outcome` is one; a future already done (its caller
    stopped waiting) is left as it is."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
