"""The streaming client against canned HTTP answers from a real socket server on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable

import httpx
import pytest

from benchmarks.serving_load import SyntheticRequest, stream_one
from benchmarks.serving_metrics import RequestResult

REQUEST = SyntheticRequest([65, 66, 67], output_len=2)
Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


def chunk(text: str, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    body = {"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": None}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def usage(tokens: int) -> bytes:
    return b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": tokens}}).encode() + b"\n\n"


async def sse_head(writer: asyncio.StreamWriter) -> None:
    # HTTP/1.0-style body delimited by closing the connection: the server decides where it ends.
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    await writer.drain()


async def against(script: Script, timeout_s: float = 10.0) -> RequestResult:
    """Runs `script` as the server's answer to one request and returns what the client recorded."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            await script(writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient() as client:
            return await stream_one(client, f"http://127.0.0.1:{port}/v1/completions", "m", REQUEST, timeout_s)
    finally:
        server.close()
        await server.wait_closed()


def test_chunk_times_and_usage_are_recorded() -> None:
    async def script(writer: asyncio.StreamWriter) -> None:
        await sse_head(writer)
        writer.write(b": a comment line\n\n" + chunk("a"))
        await writer.drain()
        await asyncio.sleep(0.05)  # the gap the client must see as an ITL
        # A token whose text is held back (part of a UTF-8 character) still comes as a chunk;
        # a chunk that only carries the finish reason is no token.
        writer.write(chunk("") + chunk("b") + chunk("", "length") + usage(3) + b"data: [DONE]\n\n")

    r = asyncio.run(against(script))
    assert r.error is None and r.output_tokens == 3
    assert len(r.chunk_times) == 3
    assert r.itls[0] >= 0.05 and r.start < r.chunk_times[0] <= r.end


@pytest.mark.parametrize("tail, error", [
    (b'data: {"error": {"message": "engine failed", "code": 500}}\n\n', "stream error: engine failed"),
    (b"data: {not json\n\n", "bad SSE data: '{not json'"),
    (b"", "stream ended without [DONE]"),
])
def test_broken_streams_are_failures(tail: bytes, error: str) -> None:
    async def script(writer: asyncio.StreamWriter) -> None:
        await sse_head(writer)
        writer.write(chunk("a") + tail)

    r = asyncio.run(against(script))
    assert r.error == error and not r.ok


def test_error_status_keeps_the_message() -> None:
    async def script(writer: asyncio.StreamWriter) -> None:
        body = json.dumps({"error": {"message": "prompt too long", "type": "invalid_request_error"}}).encode()
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)

    assert asyncio.run(against(script)).error == "HTTP 400: prompt too long"


def test_a_silent_server_times_out() -> None:
    async def script(writer: asyncio.StreamWriter) -> None:
        await sse_head(writer)
        await asyncio.Event().wait()  # never answers; the client's deadline must end it

    r = asyncio.run(against(script, timeout_s=0.3))
    assert r.error == "no complete answer within 0.3 s"


def test_refused_connection_is_a_failure() -> None:
    async def run() -> RequestResult:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        async with httpx.AsyncClient() as client:
            return await stream_one(client, f"http://127.0.0.1:{port}/v1/completions", "m", REQUEST, 5.0)

    assert asyncio.run(run()).error.startswith("ConnectError")
