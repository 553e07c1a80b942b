"""The mixed workload: short chat turns and long documents, served by conditional disaggregation,
always-disaggregate and colocated stacks on the same two cores, each loaded at rising rates.

Short turns (a few dozen prompt tokens) are what a decode worker prefills in one cheap chunk; long
documents (a thousand tokens and more) are what a prefill worker is for. Always-disaggregate queues
every short turn behind the documents on the prefill worker and moves its KV; colocated workers stall
their running streams with every document chunk; conditional disaggregation sends only the documents
to the prefill worker. Each stack gets the same requests (own seed per rate) and the same rates;
goodput is the highest rate at which `--goodput-attainment` of requests met the SLO (sweep_rules).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable

import httpx

from benchmarks.serving_load import TOKEN_ID_RANGE, LoadSpec, SyntheticRequest, fetch_model, run_load, warm_up
from benchmarks.serving_metrics import SLO, ratio
from stack.serving import Stack, StackOptions, start_colocated, start_di
from benchmarks.sweep_rules import goodput_rps, rate_point, should_stop

MIXED_SYSTEMS = ("conditional", "disaggregated", "colocated")
MIXED_RATIOS = {"conditional_over_disaggregated": "disaggregated", "conditional_over_colocated": "colocated"}
# Unset flags take these values; --quick the second (three stacks, one short rate each, in under a minute).
MIXED_DEFAULTS = {"rates": ("0.5,0.75,1,1.25,1.5,2,3", "1"), "seconds_per_rate": (24.0, 6.0)}
_MIN_PROMPTS = 6


@dataclass(frozen=True, slots=True)
class MixedWorkload:
    """Token ranges (inclusive) of the two kinds of request, and the share of short turns."""

    short_share: float = 0.75
    short_input: tuple[int, int] = (16, 64)
    short_output: tuple[int, int] = (16, 32)
    long_input: tuple[int, int] = (512, 1024)
    long_output: tuple[int, int] = (32, 32)


def mixed_requests(workload: MixedWorkload, num: int, seed: int) -> list[SyntheticRequest]:
    """`num` requests, each a short turn with probability `short_share`, else a long document; the same for
    the same seed. Random token ids: no two prompts share a prefix."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        short = rng.random() < workload.short_share
        n_in = rng.randint(*(workload.short_input if short else workload.long_input))
        n_out = rng.randint(*(workload.short_output if short else workload.long_output))
        requests.append(SyntheticRequest([rng.randint(*TOKEN_ID_RANGE) for _ in range(n_in)], n_out))
    return requests


def conditional_flags(args: argparse.Namespace, model_dir: str) -> tuple[str, ...]:
    """The proxy flags of the conditional stack (thresholds only when given: else the proxy's defaults)."""
    flags = ["--conditional-disaggregation", "--tokenizer", model_dir]
    for name in ("max_local_prefill_tokens", "max_prefill_queue"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return tuple(flags)


def mixed_starters(args: argparse.Namespace, model_dir: str) -> dict[str, Callable[[], Stack]]:
    options = StackOptions(args.core_pair, model_dir, args.kv_transport, args.startup_timeout,
                           worker_extra=tuple(args.ours_extra), threads=args.threads)
    conditional = replace(options, proxy_extra=conditional_flags(args, model_dir))
    return {"conditional": lambda: start_di(conditional), "disaggregated": lambda: start_di(options),
            "colocated": lambda: start_colocated(options)}


def mixed_sweep(name: str, stack: Stack, args: argparse.Namespace, slo: SLO) -> dict[str, Any]:
    """Warms the stack up, then loads it at each rate in turn until two rates in a row were below
    `--stop-attainment`; the conditional stack's record also says how many requests took each path."""
    model = asyncio.run(fetch_model(stack.url))
    if args.warmup:  # one short turn and one document per worker: the first prefill of a length costs extra
        asyncio.run(warm_up(stack.url, model, args.warmup, args.request_timeout,
                            (args.mixed.short_input[0], args.mixed.long_input[1])))
    points: list[dict[str, Any]] = []
    record: dict[str, Any] = {}
    for i, rate in enumerate(args.rates):
        num = max(_MIN_PROMPTS, round(rate * args.seconds_per_rate))
        spec = LoadSpec(num, (1, 1), (1, 1), rate, seed=args.seed + 1000 * i, request_timeout_s=args.request_timeout)
        results, duration = asyncio.run(run_load(stack.url, model, spec, mixed_requests(args.mixed, num, spec.seed)))
        points.append(rate_point(rate, results, duration, slo, args.stall_factor))
        print(f"{name}: {rate:g} req/s: {points[-1]['slo_attainment']:.0%} met the SLO", file=sys.stderr, flush=True)
        if should_stop(points, args.stop_attainment) and rate != args.rates[-1]:
            record["stopped_early"] = f"stopped after {rate:g} req/s: two rates in a row under {args.stop_attainment:.0%}"
            break
    if name == "conditional":
        record["paths"] = request_paths(stack.url)
    return {"rates": points, "goodput_rps": goodput_rps(points, args.goodput_attainment), **record}


def request_paths(proxy_url: str) -> dict[str, int]:
    """The proxy's count of requests by conditional-disaggregation path (warm-up included)."""
    text = httpx.get(f"{proxy_url}/metrics", timeout=10).text
    return {path: int(float(n)) for path, n in
            re.findall(r'^proxy_request_paths_total\{path="(\w+)"\} (\S+)$', text, re.M)}


def mixed_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Conditional disaggregation's goodput over each other system's."""
    ours = systems.get("conditional", {}).get("goodput_rps")
    return {name: ratio(ours, systems.get(other, {}).get("goodput_rps")) for name, other in MIXED_RATIOS.items()}
