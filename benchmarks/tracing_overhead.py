"""`bench_serving --compare-tracing`: what tracing costs. Two DI stacks on the same cores, one untraced and
one exporting every span to an OTLP/HTTP receiver in this process (stack/otlp_receiver.py), both up at
once; the same closed-loop load runs against each in alternating rounds (untraced first in even rounds,
traced first in odd ones) so that drift of a shared host falls on both alike. Reports each stack's
throughput over all its rounds and traced over untraced ratios.
"""
from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from typing import Any, Awaitable, Callable, Sequence

from benchmarks.serving_load import SyntheticRequest
from benchmarks.serving_metrics import RequestResult, ratio
from stack.otlp_receiver import OTLPReceiver
from stack.serving import StackOptions, start_di

# A closed loop of 8 clients: throughput is what the stack can do, not the arrival rate.
TRACING_DEFAULTS = {"num_prompts": (96, 24), "request_rate": (float("inf"), float("inf")),
                    "max_concurrency": (8, 8), "input_len_min": (10, 10), "input_len_max": (800, 800),
                    "output_len_min": (1, 1), "output_len_max": (32, 32)}
ROUNDS = (4, 2)   # rounds per stack: full run, --quick
TRACING_RATIOS = {"traced_request_throughput_ratio": "request_throughput",
                  "traced_output_throughput_ratio": "output_throughput"}
Measure = Callable[[str, Any, Sequence[SyntheticRequest]], Awaitable[tuple[list[RequestResult], float]]]
Runs = dict[str, tuple[list[RequestResult], float]]


def traced_options(options: StackOptions, endpoint: str) -> StackOptions:
    flag = ("--otlp-traces-endpoint", endpoint)
    return replace(options, worker_extra=(*options.worker_extra, *flag), proxy_extra=(*options.proxy_extra, *flag))


def run_tracing_compare(args: Any, requests: Sequence[SyntheticRequest], options: StackOptions,
                        measure: Measure) -> tuple[Runs, int]:
    """Each stack's requests and seconds over all rounds, and how many spans the receiver got."""
    rounds = ROUNDS[1] if args.quick else ROUNDS[0]
    runs: Runs = {"untraced": ([], 0.0), "traced": ([], 0.0)}
    with OTLPReceiver() as receiver:
        print("starting the untraced and the traced DI stacks ...", file=sys.stderr, flush=True)
        with start_di(options) as untraced, start_di(traced_options(options, receiver.endpoint)) as traced:
            stacks = {"untraced": untraced, "traced": traced}
            for index in range(rounds):
                order = ("untraced", "traced") if index % 2 == 0 else ("traced", "untraced")
                for name in order:
                    results, seconds = asyncio.run(measure(stacks[name].url, args, requests))
                    print(f"round {index + 1}/{rounds} {name}: {len(results) / seconds:.2f} req/s",
                          file=sys.stderr, flush=True)
                    runs[name] = (runs[name][0] + results, runs[name][1] + seconds)
        return runs, len(receiver.spans())


def tracing_ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Traced over untraced throughputs (1.0: tracing costs nothing)."""
    if "traced" not in summaries:
        return {}
    return {name: ratio(summaries["traced"][key], summaries["untraced"][key]) for name, key in TRACING_RATIOS.items()}
