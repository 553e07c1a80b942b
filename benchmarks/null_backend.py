"""A null backend: an OpenAI-shaped HTTP server that answers at once with a fixed 1-token completion.

It stands in for a prefill or decode worker when measuring what the proxy itself costs, so
it is written on raw asyncio (keep-alive HTTP/1.1, Content-Length bodies) to cost next to
nothing per request.

    python -m benchmarks.null_backend --port 8100
"""
from __future__ import annotations

import argparse
import asyncio
import json

_CHOICE = {"index": 0, "logprobs": None, "finish_reason": "length"}
_USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
_HEAD = {"id": "cmpl-null", "created": 0, "model": "null"}


def _response(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _sse(chunk: dict) -> bytes:
    return _response(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n", b"text/event-stream")


_COMPLETION = {**_HEAD, "object": "text_completion", "choices": [{**_CHOICE, "text": " x"}], "usage": _USAGE}
_CHAT = {**_HEAD, "object": "chat.completion", "usage": _USAGE,
         "choices": [{**_CHOICE, "message": {"role": "assistant", "content": " x"}}]}
ANSWERS = {
    (b"POST", b"/v1/completions", False): _response(json.dumps(_COMPLETION).encode()),
    (b"POST", b"/v1/completions", True): _sse({**_HEAD, "object": "text_completion",
                                               "choices": [{**_CHOICE, "text": " x"}]}),
    (b"POST", b"/v1/chat/completions", False): _response(json.dumps(_CHAT).encode()),
    (b"POST", b"/v1/chat/completions", True): _sse({**_HEAD, "object": "chat.completion.chunk",
                                                    "choices": [{**_CHOICE, "delta": {"content": " x"}}]}),
    (b"GET", b"/health", False): _response(b'{"status": "ok"}'),
    (b"GET", b"/v1/models", False): _response(b'{"object": "list", "data": [{"id": "null", "object": "model"}]}'),
}
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class NullHTTP(asyncio.Protocol):
    """Parses just enough HTTP/1.1 to answer each request from the ANSWERS table."""

    def __init__(self) -> None:
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = self._buffer[:end]
            length = _content_length(head)
            if len(self._buffer) < end + 4 + length:
                return
            body = self._buffer[end + 4:end + 4 + length]
            self._buffer = self._buffer[end + 4 + length:]
            method, path, _ = head.split(b" ", 2)
            stream = b'"stream":true' in body.replace(b" ", b"")
            self._transport.write(ANSWERS.get((method, path, stream), NOT_FOUND))


async def serve(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(NullHTTP, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
