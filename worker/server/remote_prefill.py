"""decode_first: the prefill leg a decode worker sends itself.

The proxy's `decode_first` flow sends a request to the decode worker alone; its
kv_transfer_params name the prefill worker's HTTP API (`remote_url`) next to its signal plane.
The decode worker admits the request as any decode leg (fresh blocks, a pull that retries
`lookup_all` until prefill has the KV) and meanwhile sends that prefill worker the prompt's
token ids with max_tokens=1, the same sampling (seed included) and the same request id, as
`role: prefill` (a prompt with image parts goes as the client's own chat body instead, so the prefill
worker fetches the image rows itself and renders the same prompt). The prefill's answer itself is not used: the pull brings its first token. If
the prefill leg fails before the first token is pulled, the decode request ends with a
RemotePrefillError naming the prefill worker, and its blocks are freed; if the client goes
away first, the prefill leg is cancelled (its connection closed, so prefill frees the request).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

import httpx

from common.handoff import KV_TRANSFER_PARAMS, PrefillParams
from common.tracing import current_headers
from worker.engine.request import RequestOutput
from worker.errors import RemotePrefillError
from worker.model.logprobs import TokenLogprobs
from worker.server.async_engine import RequestStream
from worker.server.token_text import parse_token_id

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0  # the answer itself is bounded by the pull's timeout, which fails the request first


class RemotePrefills:
    """The prefill legs this decode worker sends, over one HTTP client for the app's life."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[TokenLogprobs | None]] = set()

    def start(self, url: str, request_id: str, path: str, leg: dict[str, Any]) -> asyncio.Task[TokenLogprobs | None]:
        """Sends `leg` (a request body) to `path` of the worker at `url` as the prefill leg of `request_id`:
        one token, not streamed (at most one min_tokens, so it may be asked for); the task fails with
        RemotePrefillError. Where the leg asks for logprobs, they come back naming token ids and the task's
        result is the first token's entry."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
        body = prefill_leg_body(request_id, leg)
        task = asyncio.ensure_future(_prefill(self._client, f"{url}{path}", request_id, body))
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[TokenLogprobs | None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.debug("%s", exc)  # first_output raised it if it came before the first token

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def prefill_leg_body(request_id: str, leg: dict[str, Any]) -> dict[str, Any]:
    """`leg` (a request body) as the prefill leg of `request_id`: one token, not streamed (at most one
    min_tokens, so it may be asked for); logprobs, where asked for, naming token ids."""
    body = {**leg, "max_tokens": 1, "stream": False, KV_TRANSFER_PARAMS: PrefillParams(request_id).to_dict()}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if body.get("min_tokens"):
        body["min_tokens"] = 1
    if body.get("logprobs") not in (None, False):
        body["return_tokens_as_token_ids"] = True
    body.pop("stream_options", None)
    return body


async def first_output(stream: RequestStream, prefill: asyncio.Task[TokenLogprobs | None]) -> RequestOutput:
    """The decode request's first output (its pulled token, with the prefill's logprobs of it if asked
    for), unless its prefill leg fails first; then that failure. Leaving early (the client went away)
    cancels the prefill leg; the caller aborts `stream`."""
    first = asyncio.ensure_future(stream.__anext__())
    try:
        await asyncio.wait({first, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done() and not prefill.cancelled() and prefill.exception() is not None:
            raise prefill.exception()  # type: ignore[misc]
        out = await first
        if out.logprobs == [None]:   # sampled on the prefill worker: its answer has the entry
            out = dataclasses.replace(out, logprobs=[await prefill])
        return out
    except BaseException:
        first.cancel()
        prefill.cancel()
        raise


async def _prefill(client: httpx.AsyncClient, url: str, request_id: str,
                   body: dict[str, Any]) -> TokenLogprobs | None:
    where = f"prefill worker {url}"
    try:
        reply = await client.post(url, json=body, headers={"X-Request-Id": request_id, **current_headers()})
    except httpx.HTTPError as exc:
        raise RemotePrefillError(f"remote prefill of request {request_id!r} on {where} failed: "
                                 f"{type(exc).__name__}: {exc or 'the connection was lost'}") from exc
    if reply.status_code != 200:
        raise RemotePrefillError(f"remote prefill of request {request_id!r} on {where} answered HTTP "
                                 f"{reply.status_code}: {error_message(reply.content)}",
                                 retryable=reply.status_code == 503)
    return first_logprobs(reply.json()) if body.get("return_tokens_as_token_ids") else None


def first_logprobs(answer: dict[str, Any]) -> TokenLogprobs | None:
    """The first token's logprobs in a one-token answer whose logprobs name token ids (completions or chat)."""
    logprobs = answer["choices"][0].get("logprobs")
    if not logprobs:
        return None
    if "content" in logprobs:
        entry = logprobs["content"][0]
        token, logprob = entry["token"], entry["logprob"]
        top = [(t["token"], t["logprob"]) for t in entry["top_logprobs"]]
    else:
        token, logprob = logprobs["tokens"][0], logprobs["token_logprobs"][0]
        top = list(logprobs["top_logprobs"][0].items())
    token_id = parse_token_id(token)
    alternatives = tuple((parse_token_id(t), lp) for t, lp in top)
    if token_id is None or any(t is None for t, _ in alternatives):
        return None
    # The rank is not in the answer; no format a decode leg gives shows it.
    return TokenLogprobs(token_id, logprob, 0, tuple((t, lp) for t, lp in alternatives if t != token_id))


def error_message(body: bytes) -> str:
    """The message of a worker's OpenAI error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return repr(body[:200])

