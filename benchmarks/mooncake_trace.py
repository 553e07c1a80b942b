"""Replays a trace in the Mooncake format: JSON lines `{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`, where each hash id names one block of `block_tokens` prompt tokens (512 in Mooncake's
traces) and equal ids are equal blocks. Every hash id becomes the same block of token ids each time, so
requests that share ids share a prefix exactly as in the trace. `scale` divides lengths and the block size
alike (a public trace's 8k-token prompts on a 2k-context model); `time_scale` stretches the arrival times.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import httpx

from benchmarks.serving_load import progress, stream_body
from benchmarks.serving_metrics import RequestResult

MOONCAKE_BLOCK_TOKENS = 512
TOKEN_RANGE = (32, 127)   # printable bytes: every model's tokenizer here has them


@dataclass(frozen=True, slots=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(lines: Iterable[str]) -> list[TraceRow]:
    """The rows of a Mooncake trace; ValueError naming the line that is not one."""
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            row = TraceRow(float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                           tuple(int(h) for h in obj.get("hash_ids", ())))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace line {number} is not a Mooncake row: {exc!r}") from exc
        if row.input_length < 1 or row.output_length < 1:
            raise ValueError(f"trace line {number}: input_length and output_length must be positive")
        rows.append(row)
    return sorted(rows, key=lambda r: r.timestamp_ms)


def load_trace(path: Path) -> list[TraceRow]:
    with open(path) as f:
        return read_trace(f)


def trace_prompt(row: TraceRow, block_tokens: int, scale: int = 1) -> list[int]:
    """The prompt token ids of `row`: its hash ids' blocks in order, cut (or padded with a block of its own)
    to input_length, both divided by `scale`."""
    size, length = max(block_tokens // scale, 1), max(row.input_length // scale, 1)
    ids: list[int] = []
    for h in row.hash_ids:
        rng = random.Random(h)
        ids += [rng.randrange(*TOKEN_RANGE) for _ in range(size)]
        if len(ids) >= length:
            break
    rng = random.Random(f"tail {row.timestamp_ms} {row.hash_ids[-1:] or ''}")
    ids += [rng.randrange(*TOKEN_RANGE) for _ in range(length - len(ids))]
    return ids[:length]


def synthetic_trace(num_requests: int, rate: float, num_prefixes: int, prefix_blocks: int,
                    blocks: tuple[int, int], output_length: int, seed: int = 0) -> list[TraceRow]:
    """A trace of our own in the same format: Poisson arrivals at `rate`, each prompt one of `num_prefixes`
    shared prefixes of `prefix_blocks` blocks followed by blocks of its own."""
    rng, t, rows, fresh = random.Random(seed), 0.0, [], 10**6
    for _ in range(num_requests):
        t += rng.expovariate(rate) * 1000
        n = rng.randint(*blocks)
        prefix = rng.randrange(num_prefixes) * prefix_blocks
        own = list(range(fresh, fresh + max(n - prefix_blocks, 1)))
        fresh += len(own)
        ids = tuple(range(prefix, prefix + prefix_blocks)) + tuple(own)
        rows.append(TraceRow(round(t, 3), len(ids) * MOONCAKE_BLOCK_TOKENS, output_length, ids))
    return rows


def trace_lines(rows: Sequence[TraceRow]) -> list[str]:
    return [json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) for r in rows]


async def run_trace(base_url: str, model: str, rows: Sequence[TraceRow], block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                    scale: int = 1, time_scale: float = 1.0, timeout_s: float = 300.0) -> tuple[list[RequestResult], float]:
    """Sends every row at its (scaled) time as a streamed token-id prompt; the results and the duration."""
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    with progress(len(rows), "trace rows") as bar:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            t0 = time.perf_counter()

            async def one(row: TraceRow) -> RequestResult:
                await asyncio.sleep(max(row.timestamp_ms / 1000 * time_scale - (time.perf_counter() - t0), 0))
                prompt, out = trace_prompt(row, block_tokens, scale), max(row.output_length // scale, 1)
                body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": out, "ignore_eos": True,
                                        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
                return await stream_body(client, url, body, RequestResult(len(prompt), out), timeout_s, bar)

            results = await asyncio.gather(*(one(r) for r in rows))
    return list(results), time.perf_counter() - t0
