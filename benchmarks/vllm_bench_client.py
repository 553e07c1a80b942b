"""Loading a server with vLLM's own client, `vllm bench serve`, and reading its saved result.

Random prompts of fixed lengths, a fixed seed, --ignore-eos, against `/v1/completions`: the
same load for any OpenAI-compatible server, ours or `vllm serve`. The client's flags live here
and nowhere else.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

CLIENT = "vllm bench serve --backend openai --dataset-name random --ignore-eos --endpoint /v1/completions"
# Our name -> the key `vllm bench serve` writes in its saved result.
CLIENT_KEYS = {"request_throughput": "request_throughput", "ttft_mean_ms": "mean_ttft_ms",
               "ttft_p99_ms": "p99_ttft_ms", "tpot_mean_ms": "mean_tpot_ms", "tpot_p99_ms": "p99_tpot_ms",
               "itl_p50_ms": "median_itl_ms", "itl_p99_ms": "p99_itl_ms", "completed": "completed",
               "failed": "failed", "total_input_tokens": "total_input_tokens",
               "total_output_tokens": "total_output_tokens", "duration_s": "duration",
               "output_throughput": "output_throughput"}


# A gap between two tokens of a stream longer than this many times the run's median ITL is a stall: the
# step that made it also computed prompt tokens (a chunk of another request's prefill), not just decodes.
STALL_FACTOR = 3.0


class ClientError(RuntimeError):
    """`vllm bench serve` failed, timed out or wrote a result without the keys we read."""


@dataclass(frozen=True, slots=True)
class ClientLoad:
    """One run of the client: `num_prompts` measured requests after `num_warmups` unmeasured ones."""

    tokenizer: str          # the model directory: prompts are made of its tokens
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int = 8
    num_warmups: int = 8
    seed: int = 0
    timeout_s: float = 900.0


def served_model(url: str) -> str:
    """The model id the server at `url` answers to (its first in GET /v1/models)."""
    try:
        return httpx.get(f"{url}/v1/models", timeout=30.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ClientError(f"cannot read the served model name from {url}/v1/models: {exc!r}") from exc


def client_args(load: ClientLoad, url: str, model: str, result: Path) -> list[str]:
    """`vllm bench serve`'s command line, saving its result to `result`."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
            "--base-url", url, "--endpoint", "/v1/completions", "--model", model, "--tokenizer", load.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len), "--num-prompts", str(load.num_prompts),
            "--max-concurrency", str(load.max_concurrency), "--num-warmups", str(load.num_warmups),
            "--ignore-eos", "--seed", str(load.seed), "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "99", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name]


def run_client(load: ClientLoad, url: str, model: str, result: Path) -> dict[str, Any]:
    """Runs the client to the end (or its timeout) and returns its saved result."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        done = subprocess.run(client_args(load, url, model, result), capture_output=True, text=True,
                              timeout=load.timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        raise ClientError(f"vllm bench serve did not finish within {load.timeout_s:g} s") from exc
    if done.returncode != 0 or not result.exists():
        raise ClientError(f"vllm bench serve exited with status {done.returncode}:\n"
                          f"{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(result.read_text())


def client_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """Our metrics from `vllm bench serve`'s saved result, plus its first request error."""
    missing = sorted(key for key in CLIENT_KEYS.values() if key not in result)
    if missing:
        raise ClientError(f"vllm bench serve's result has no {missing}")
    metrics = {ours: result[theirs] for ours, theirs in CLIENT_KEYS.items()}
    metrics["first_error"] = next((e for e in result.get("errors", []) if e), None)
    return metrics | gap_stats(result.get("itls"), result["median_itl_ms"])


def gap_stats(itls: list[list[float]] | None, median_itl_ms: float) -> dict[str, float | None]:
    """Stalls per request (gaps over STALL_FACTOR x the median ITL) and the largest gap, from the
    per-request inter-token gaps (seconds) `--save-detailed` saves; None for both without them."""
    gaps = [gap * 1000 for request in itls or [] for gap in request]
    if not gaps:
        return {"stalls_per_request": None, "largest_gap_ms": None}
    stalls = sum(gap > STALL_FACTOR * median_itl_ms for gap in gaps)
    return {"stalls_per_request": stalls / len(itls or []), "largest_gap_ms": max(gaps)}
