"""Reading a Quart request's body so that a client leaving still cancels the handler, and a
client sending a body over the size limit reads its 413."""
from __future__ import annotations

import asyncio
import contextlib

from quart import Request, request
from quart.wrappers.request import Body
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

# How much of a body over MAX_CONTENT_LENGTH is still read (and dropped) so its client sees the 413.
DISCARD_LIMIT_BYTES = 256 << 20


class DrainingBody(Body):
    """A request body that knows when its client has sent all of it, even past the size limit.

    Quart drops what arrives past MAX_CONTENT_LENGTH, and hypercorn closes a connection whose
    request is still arriving when the response ends: clients that write their whole body
    before reading (httpx, the openai client) then see a reset, not the 413. Waiting for
    `arrived` before answering lets hypercorn read the rest, up to DISCARD_LIMIT_BYTES.
    """

    def __init__(self, expected_content_length: int | None, max_content_length: int | None) -> None:
        super().__init__(expected_content_length, max_content_length)
        self.arrived = asyncio.Event()
        self.received = 0
        self._appending = False

    def append(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > DISCARD_LIMIT_BYTES:
            self.arrived.set()      # past the bound: answer now, and the connection closes
        self._appending = True
        try:
            super().append(data)    # completes the body itself when it passes the limit
        finally:
            self._appending = False

    def set_complete(self) -> None:
        super().set_complete()
        if not self._appending:     # the client's last byte, not the limit
            self.arrived.set()


class DrainingRequest(Request):
    """Quart's request with a DrainingBody: set it as an app's `request_class`."""

    body_class = DrainingBody


async def request_body() -> bytes:
    """The current request's whole body; a 408 after Quart's BODY_TIMEOUT, as get_data gives,
    and a 413 over MAX_CONTENT_LENGTH once the client has sent the rest (with DrainingRequest).

    Not `request.get_data()`: it waits in asyncio.wait_for, which on Python 3.11 drops a
    cancellation that arrives as the body completes. Quart cancels the handler when the client
    disconnects, so a client that closes right after sending would be served to the end for
    nobody (by the proxy both legs, by a worker the whole generation).
    """
    try:
        async with asyncio.timeout(request.body_timeout):
            return await request.body
    except TimeoutError as exc:
        raise RequestTimeout() from exc
    except RequestEntityTooLarge:
        body = request.body
        if isinstance(body, DrainingBody):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(request.body_timeout):
                    await body.arrived.wait()
        raise
