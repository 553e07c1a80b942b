"""Clients of a fault campaign: every call has a deadline and ends in exactly one verdict.

    ok       a whole answer: HTTP 200 with choices, or a stream ending in [DONE] with no error
    error    a clear error: an OpenAI-style JSON error body whose code is the HTTP status, or an
             SSE error event followed by [DONE]
    cut      the connection was refused or cut, or a stream ended without [DONE]: a clear error
             only when the process serving it (the proxy) was killed on purpose
    unclear  any other answer (a bare status, a body that is not an OpenAI error, bad SSE)
    hung     still open at its deadline
"""
from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import httpx

OK, ERROR, CUT, UNCLEAR, HUNG = "ok", "error", "cut", "unclear", "hung"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call ended; `text` is the completion's text when it is `ok`."""

    verdict: str
    detail: str = ""
    text: str = ""
    status: int = 0


async def call(client: httpx.AsyncClient, url: str, body: dict[str, Any], deadline_s: float,
               read_delay_s: float = 0.0) -> Outcome:
    """POSTs `body` to `url` (streamed when body["stream"]); a stream reader waits `read_delay_s`
    between events, as a slow client does."""
    try:
        return await asyncio.wait_for(_call(client, url, body, read_delay_s), deadline_s)
    except asyncio.TimeoutError:
        return Outcome(HUNG, f"no complete answer within {deadline_s:g} s")
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return Outcome(CUT, f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        return Outcome(UNCLEAR, f"{type(exc).__name__}: {exc}")


async def _call(client: httpx.AsyncClient, url: str, body: dict[str, Any], read_delay_s: float) -> Outcome:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200 or not body.get("stream"):
            return answer(response.status_code, await response.aread())
        return await _events(response, read_delay_s)


def answer(status: int, raw: bytes) -> Outcome:
    """The verdict on a whole (not streamed) answer."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        return Outcome(UNCLEAR, f"HTTP {status}, not JSON: {raw[:200]!r}", status=status)
    if status == 200:
        choices = parsed.get("choices") if isinstance(parsed, dict) else None
        if not choices or choices[0].get("finish_reason") is None:
            return Outcome(UNCLEAR, f"HTTP 200 without a finished choice: {raw[:200]!r}", status=status)
        return Outcome(OK, text=str(choices[0].get("text", "")), status=status)
    problem = error_problem(parsed, status)
    return Outcome(UNCLEAR if problem else ERROR, problem or _message(parsed), status=status)


def error_problem(parsed: Any, status: int | None) -> str:
    """What keeps `parsed` from being an OpenAI-style error (for HTTP `status`); '' when it is one."""
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"]:
        return f"HTTP {status}: no OpenAI error body: {json.dumps(parsed)[:200]}"
    if status is not None and error.get("code") != status:
        return f"HTTP {status}: error code {error.get('code')!r} is not the status: {error['message']}"
    return ""


async def _events(response: httpx.Response, read_delay_s: float) -> Outcome:
    text: list[str] = []
    failure: str | None = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return Outcome(ERROR, failure, status=200) if failure else Outcome(OK, text="".join(text), status=200)
        if failure is not None:
            return Outcome(UNCLEAR, f"an event after the error event: {data[:200]}", status=200)
        try:
            event = json.loads(data)
        except ValueError:
            return Outcome(UNCLEAR, f"bad SSE data: {data[:200]!r}", status=200)
        if "error" in event:
            failure = error_problem(event, None)
            if failure:
                return Outcome(UNCLEAR, f"stream {failure}", status=200)
            failure = f"stream error: {_message(event)}"
            continue
        text.extend(choice.get("text") or "" for choice in event.get("choices") or ())
        if read_delay_s:
            await asyncio.sleep(read_delay_s)  # a slow reader: the server's writes back up meanwhile
    return Outcome(CUT, "stream ended without [DONE]" + (f" after {failure}" if failure else ""), status=200)


def _message(parsed: dict[str, Any]) -> str:
    """The error's type (when it names one) and message."""
    error = parsed["error"]
    kind = error.get("type")
    return f"{kind}: {error['message']}" if isinstance(kind, str) and kind else str(error["message"])


async def leave(port: int, path: str, body: dict[str, Any], rng: random.Random) -> None:
    """A client that sends a whole request and closes the connection before the first byte of the
    answer, after a random wait (0 to 0.3 s: queued, prefilling, or pulling)."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
    await writer.drain()
    try:
        await asyncio.wait_for(reader.read(1), rng.uniform(0.0, 0.3))  # gone before the first byte, if any
    except asyncio.TimeoutError:
        pass
    writer.close()


async def leave_mid_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], events: int) -> Outcome:
    """A streaming client that reads `events` SSE events and closes the connection; an answer
    that is no 200 stream is judged as any other."""
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            return answer(response.status_code, await response.aread())
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data:")
            if seen >= events:
                return Outcome(OK, "left mid-stream")
    return Outcome(OK, "the stream ended before the client left")
