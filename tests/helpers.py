"""Shared test utilities: polling with a deadline, a client that leaves early. Processes, free ports and
etcd come from `stack`, as the benchmarks' and the fault campaign's do."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05,
               what: str = "condition") -> T:
    """Polls `predicate` until it returns a truthy value; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the predicate may fail until the thing is up
            last_error = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_error!r}")


async def send_and_leave(port: int, path: str, body: dict[str, Any], delay: float = 0.0,
                         until: asyncio.Event | None = None) -> None:
    """A client that sends a whole POST request to 127.0.0.1:`port` and closes the connection
    `delay` seconds later (or once `until` is set) without reading a byte of the answer. Should the
    server answer (or close) before `until` is set, it fails at once with what came."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
    await writer.drain()
    if until is not None:
        answer, waited = asyncio.ensure_future(reader.read(4096)), asyncio.ensure_future(until.wait())
        await asyncio.wait({answer, waited}, return_when=asyncio.FIRST_COMPLETED)
        for task in (answer, waited):
            task.cancel()
        if not until.is_set():
            writer.close()
            raise AssertionError(f"the server answered before the client was to leave: {answer.result()[:800]!r}")
    await asyncio.sleep(delay)  # the request's stage when its client leaves
    writer.close()
    await writer.wait_closed()
