"""The open-loop load: synthetic prompts, Poisson arrivals, and a streaming OpenAI client.

Open loop means a request is sent at its arrival time whether or not earlier ones have
finished (unless `max_concurrency` caps how many are in flight), so a slow server faces a
growing queue instead of a slower client.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import httpx
from tqdm import tqdm

from benchmarks.serving_metrics import RequestResult

# Printable ASCII: one token each for a byte-level model, and valid ids in any real vocabulary.
TOKEN_ID_RANGE = (32, 126)


class LoadError(RuntimeError):
    """The endpoint cannot be benchmarked at all (unreachable, no model, failing warm-up)."""


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    """One prompt of token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What to send and when: lengths are inclusive ranges; rate in requests/s (inf: all at once)."""

    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be at least 1")
        for name in ("input_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}: need 1 <= min <= max, got {low}..{high}")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be positive (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")


def make_requests(spec: LoadSpec) -> list[SyntheticRequest]:
    """The same prompts for the same seed, whatever is being measured."""
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_prompts):
        n_in = rng.randint(*spec.input_len)
        prompt = [rng.randint(*TOKEN_ID_RANGE) for _ in range(n_in)]
        requests.append(SyntheticRequest(prompt, rng.randint(*spec.output_len)))
    return requests


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process (exponential gaps), or all at 0."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)  # its own stream, so changing the rate leaves the prompts alone
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def completion_body(model: str, request: SyntheticRequest) -> dict[str, Any]:
    return {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


@contextlib.contextmanager
def progress(total: int, what: str | None) -> Iterator[tqdm]:
    """A bar on stderr counting a load's answers (shown on a terminal only; never when `what` is None), gone once
    the load ended."""
    bar = tqdm(total=total, desc=what, unit="req", leave=False, disable=None if what else True)
    try:
        yield bar
    finally:
        bar.close()


async def stream_one(client: httpx.AsyncClient, url: str, model: str, request: SyntheticRequest,
                     timeout_s: float, bar: tqdm | None = None) -> RequestResult:
    """Sends one streamed completion and records when each content chunk arrived; never raises."""
    result = RequestResult(len(request.prompt_token_ids), request.output_len)
    return await stream_body(client, url, completion_body(model, request), result, timeout_s, bar)


async def stream_body(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult,
                      timeout_s: float, bar: tqdm | None = None) -> RequestResult:
    """Sends the streamed completion `body`, recording its chunks' times and text into `result` (and counting it
    on `bar` once it ended); never raises."""
    result.start = time.perf_counter()
    try:
        await asyncio.wait_for(_exchange(client, url, body, result), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"no complete answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    if result.error is None and not result.output_tokens:
        result.output_tokens = len(result.chunk_times)
    if bar is not None:
        bar.update()
    return result


async def _exchange(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult) -> None:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            result.error = _error_text(response.status_code, await response.aread())
        else:
            await _read_events(response, result)


async def _read_events(response: httpx.Response, result: RequestResult) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, other SSE fields
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            result.error = f"bad SSE data: {data[:200]!r}"
            return
        if "error" in event:
            result.error = f"stream error: {_message(event)}"
            return
        # Workers send one chunk per token; its text may be empty (part of a UTF-8 character).
        # An empty chunk that only carries the finish reason (or, in a chat, the role) is no token arrival.
        choices = event.get("choices") or ()
        texts = [_chunk_text(choice) for choice in choices]
        if any(text or (text is not None and choice.get("finish_reason") is None)
               for text, choice in zip(texts, choices)):
            result.chunk_times.append(time.perf_counter())
        result.text += "".join(text or "" for text in texts)
        if event.get("usage"):
            result.output_tokens = int(event["usage"].get("completion_tokens", 0))
            result.input_tokens = int(event["usage"].get("prompt_tokens", result.input_tokens))
    result.error = "stream ended without [DONE]"


def _chunk_text(choice: dict[str, Any]) -> str | None:
    """A completion chunk's text, or a chat chunk's content (None: the chunk carries none, as a chat's role chunk
    with empty content)."""
    if "delta" not in choice:
        return choice.get("text")
    delta = choice.get("delta") or {}
    content = delta.get("content")
    return None if content is None or ("role" in delta and not content) else content


def _error_text(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {_message(json.loads(body))}"
    except ValueError:
        return f"HTTP {status}: {body[:200]!r}"


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message", error)) if isinstance(error, dict) else str(error or body)


async def run_load(base_url: str, model: str, spec: LoadSpec, requests: Sequence[SyntheticRequest],
                   what: str | None = "load") -> tuple[list[RequestResult], float]:
    """Sends every request at its arrival time (counted on a progress bar named `what`; None: no bar); returns
    the results in order and the run's duration."""
    if not requests:
        raise ValueError("no requests to send")
    url = base_url.rstrip("/") + "/v1/completions"
    gate = asyncio.Semaphore(spec.max_concurrency or len(requests))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    with progress(len(requests), what) as bar:
        async with httpx.AsyncClient(timeout=httpx.Timeout(spec.request_timeout_s), limits=limits) as client:
            t0 = time.perf_counter()

            async def send_at(offset: float, request: SyntheticRequest) -> RequestResult:
                await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))  # the arrival schedule
                async with gate:
                    return await stream_one(client, url, model, request, spec.request_timeout_s, bar)

            offsets = arrival_offsets(len(requests), spec.request_rate, spec.seed)
            results = await asyncio.gather(*(send_at(o, r) for o, r in zip(offsets, requests)))
    duration = max(r.end for r in results) - min(r.start for r in results)
    return list(results), duration


async def warm_up(base_url: str, model: str, count: int, timeout_s: float = 300.0,
                  input_len: tuple[int, int] = (16, 16)) -> None:
    """Sends `count` requests of 4 output tokens one at a time, unmeasured; a failing one is a LoadError."""
    spec = LoadSpec(count, input_len, (4, 4), max_concurrency=1, seed=12345, request_timeout_s=timeout_s)
    results, _ = await run_load(base_url, model, spec, make_requests(spec), what=None)
    errors = [r.error for r in results if not r.ok]
    if errors:
        raise LoadError(f"warm-up requests to {base_url} failed: {errors[0]}")


async def fetch_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model the endpoint serves."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise LoadError(f"cannot read the model name from {url}: {exc!r}") from exc
