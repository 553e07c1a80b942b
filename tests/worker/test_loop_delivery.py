"""Handing outputs from another thread to an event loop: every item arrives in order, each loop is woken
once per batch, and a closed loop drops the batch without raising."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator

import pytest

from worker.server.loop_delivery import Sink, deliver_all, settle


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the callbacks other threads hand it."""

    handed = 0

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:
        self.handed += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


@pytest.fixture()
def loop() -> Iterator[CountingLoop]:
    loop = CountingLoop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def drain(loop: asyncio.AbstractEventLoop, sink: Sink, n: int) -> list[Any]:
    async def read() -> list[Any]:
        return [await asyncio.wait_for(sink.queue.get(), 10) for _ in range(n)]
    return asyncio.run_coroutine_threadsafe(read(), loop).result(20)


def sinks_on(loop: asyncio.AbstractEventLoop, n: int) -> list[Sink]:
    async def make() -> list[Sink]:
        return [Sink(loop, asyncio.Queue()) for _ in range(n)]
    return asyncio.run_coroutine_threadsafe(make(), loop).result(10)


def test_a_batch_wakes_each_loop_once_and_keeps_each_queues_order(loop: CountingLoop) -> None:
    first, second = sinks_on(loop, 2)
    before = loop.handed
    error = RuntimeError("the engine stopped")
    deliver_all([(first, "a1"), (second, "b1"), (first, "a2"), (second, error)])
    assert loop.handed - before == 1
    assert drain(loop, first, 2) == ["a1", "a2"]
    assert drain(loop, second, 2) == ["b1", error]


def test_two_loops_are_each_woken_once(loop: CountingLoop) -> None:
    other = CountingLoop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    try:
        (mine,), (theirs,) = sinks_on(loop, 1), sinks_on(other, 1)
        before = (loop.handed, other.handed)
        deliver_all([(mine, 1), (theirs, 2), (mine, 3)])
        assert (loop.handed - before[0], other.handed - before[1]) == (1, 1)
        assert drain(loop, mine, 2) == [1, 3] and drain(other, theirs, 1) == [2]
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(10)
        other.close()


def test_a_closed_loop_drops_the_batch_quietly() -> None:
    closed = asyncio.new_event_loop()
    sink = Sink(closed, asyncio.Queue())
    closed.close()
    deliver_all([(sink, "late")])   # nobody is left to read it: no exception reaches the engine thread
    assert sink.queue.empty()


def test_settle_sets_a_result_or_an_exception_once() -> None:
    loop = asyncio.new_event_loop()
    try:
        done, failed = loop.create_future(), loop.create_future()
        settle(done, 3)
        settle(done, 4)   # already done: left as it was
        settle(failed, ValueError("no"))
        assert done.result() == 3
        assert isinstance(failed.exception(), ValueError)
    finally:
        loop.close()
