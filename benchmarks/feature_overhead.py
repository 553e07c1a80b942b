"""`bench_serving --compare-tracing` / `--compare-integrity`: what one feature costs. Two DI stacks on the same
cores, the feature off in one and on in the other, both up at once; the same closed-loop load runs against each
in alternating rounds (off first in even rounds, on first in odd ones) so that drift of a shared host falls on
both alike. Reports each stack's figures over all its rounds and on-over-off ratios.

- tracing: the on stack exports every span to an OTLP/HTTP receiver in this process (stack/otlp_receiver.py);
- integrity: the KV checksum of every pull, on by default, is turned off (`--no-kv-integrity-check`) in the
  off stack.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Sequence

from benchmarks.serving_load import SyntheticRequest
from benchmarks.serving_metrics import RequestResult, ratio
from stack.otlp_receiver import OTLPReceiver
from stack.serving import StackOptions, start_di

# A closed loop of 8 clients: throughput is what the stack can do, not the arrival rate.
OVERHEAD_DEFAULTS = {"num_prompts": (96, 24), "request_rate": (float("inf"), float("inf")),
                     "max_concurrency": (8, 8), "input_len_min": (10, 10), "input_len_max": (800, 800),
                     "output_len_min": (1, 1), "output_len_max": (32, 32)}
ROUNDS = (4, 2)   # rounds per stack: full run, --quick
Measure = Callable[[str, Any, Sequence[SyntheticRequest]], Awaitable[tuple[list[RequestResult], float]]]
Runs = dict[str, tuple[list[RequestResult], float]]


@dataclass(frozen=True)
class Feature:
    """A feature measured on against off: the runs' names and the ratios (name -> summary key and statistic,
    None for a scalar), on over off."""

    off: str
    on: str
    ratios: dict[str, tuple[str, str | None]]


FEATURES = {
    "tracing": Feature("untraced", "traced", {"traced_request_throughput_ratio": ("request_throughput", None),
                                              "traced_output_throughput_ratio": ("output_throughput", None)}),
    "integrity": Feature("unchecked", "checked", {"checked_e2e_p50_ratio": ("e2e_ms", "p50"),
                                                  "checked_request_throughput_ratio": ("request_throughput", None)}),
}
OVERHEAD_RATIOS = tuple(name for feature in FEATURES.values() for name in feature.ratios)


def _with_flags(options: StackOptions, flags: tuple[str, ...], proxy: bool) -> StackOptions:
    return replace(options, worker_extra=(*options.worker_extra, *flags),
                   proxy_extra=(*options.proxy_extra, *flags) if proxy else options.proxy_extra)


def run_overhead_compare(name: str, args: Any, requests: Sequence[SyntheticRequest], options: StackOptions,
                         measure: Measure) -> tuple[Runs, int | None]:
    """Each stack's requests and seconds over all rounds, and (tracing) how many spans the receiver got."""
    feature, rounds = FEATURES[name], ROUNDS[1] if args.quick else ROUNDS[0]
    runs: Runs = {feature.off: ([], 0.0), feature.on: ([], 0.0)}
    with contextlib.ExitStack() as started:
        receiver = started.enter_context(OTLPReceiver()) if name == "tracing" else None
        if receiver is not None:
            off, on = options, _with_flags(options, ("--otlp-traces-endpoint", receiver.endpoint), proxy=True)
        else:
            off, on = _with_flags(options, ("--no-kv-integrity-check",), proxy=False), options
        print(f"starting the {feature.off} and the {feature.on} DI stacks ...", file=sys.stderr, flush=True)
        stacks = {feature.off: started.enter_context(start_di(off)), feature.on: started.enter_context(start_di(on))}
        for index in range(rounds):
            order = (feature.off, feature.on) if index % 2 == 0 else (feature.on, feature.off)
            for run in order:
                results, seconds = asyncio.run(measure(stacks[run].url, args, requests))
                print(f"round {index + 1}/{rounds} {run}: {len(results) / seconds:.2f} req/s",
                      file=sys.stderr, flush=True)
                runs[run] = (runs[run][0] + results, runs[run][1] + seconds)
        return runs, None if receiver is None else len(receiver.spans())


def overhead_ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """On over off (1.0: the feature costs nothing) for the feature whose runs `summaries` holds."""
    for feature in FEATURES.values():
        if feature.on in summaries:
            return {name: ratio(_figure(summaries[feature.on], key, stat), _figure(summaries[feature.off], key, stat))
                    for name, (key, stat) in feature.ratios.items()}
    return {}


def _figure(summary: dict[str, Any], key: str, stat: str | None) -> float:
    return summary[key] if stat is None else summary[key][stat]
