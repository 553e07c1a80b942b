"""The multi-turn workload on the DI 1P1D stack with prefix-aware transfer on, then off.

Both runs send the same conversations (benchmarks/multiturn_load.py). The decode worker's /metrics
count the KV blocks and bytes each pull moved and the cached ones it skipped; their growth over
the measured run, per request, is the number compared: KV bytes moved per request on over off.
"""
from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, replace
from typing import Any, Mapping

from benchmarks.multiturn_load import MultiturnSpec, run_multiturn
from benchmarks.serving_load import fetch_model, warm_up
from benchmarks.serving_metrics import RequestResult, ratio
from stack.serving import StackOptions, start_di
from stack.worker_metrics import metric_sum

# Stack name -> the flags of its workers (the prefill worker ignores this decode-side flag).
PREFIX_STACKS = {"prefix_aware": (), "full_transfer": ("--no-prefix-aware-transfer",)}
KV_METRICS = {"pulls": "neuron_di_kv_pulls_total", "blocks_pulled": "neuron_di_kv_blocks_pulled_total",
              "blocks_skipped": "neuron_di_kv_blocks_skipped_total", "bytes_pulled": "neuron_di_kv_bytes_pulled_total",
              "bytes_skipped": "neuron_di_kv_bytes_skipped_total"}
DECODE = "decode worker"


@dataclass(slots=True)
class PrefixRun:
    """One stack's measured run: the turns' results, its duration and the decode worker's KV counts."""

    results: list[RequestResult]
    duration_s: float
    kv: dict[str, int]


def kv_counts(decode_url: str) -> dict[str, int]:
    return {key: metric_sum(decode_url, name) for key, name in KV_METRICS.items()}


async def _measure(url: str, decode_url: str, spec: MultiturnSpec, warmup: int,
                   model_name: str | None) -> PrefixRun:
    model = model_name or await fetch_model(url)
    if warmup:
        await warm_up(url, model, warmup, spec.request_timeout_s)
    before = kv_counts(decode_url)
    results, duration = await run_multiturn(url, model, spec)
    after = kv_counts(decode_url)
    return PrefixRun(results, duration, {key: after[key] - before[key] for key in KV_METRICS})


def run_prefix_stacks(spec: MultiturnSpec, options: StackOptions, warmup: int,
                      model_name: str | None = None) -> dict[str, PrefixRun]:
    """The same conversations on a DI stack per entry of PREFIX_STACKS, one after the other."""
    runs: dict[str, PrefixRun] = {}
    for name, flags in PREFIX_STACKS.items():
        print(f"starting the DI stack ({name}) ...", file=sys.stderr, flush=True)
        with start_di(replace(options, worker_extra=(*options.worker_extra, *flags))) as stack:
            runs[name] = asyncio.run(_measure(stack.url, stack.worker_urls[DECODE], spec, warmup, model_name))
    return runs


def kv_summary(kv: Mapping[str, int]) -> dict[str, Any]:
    """The run's KV counts and, per pull (one per disaggregated request), bytes and blocks moved and skipped."""
    pulls = kv["pulls"]
    per = {f"{key}_per_request": (kv[key] / pulls if pulls else None)
           for key in ("bytes_pulled", "bytes_skipped", "blocks_pulled", "blocks_skipped")}
    return {**kv, **per}


def prefix_report(runs: Mapping[str, PrefixRun]) -> dict[str, Any]:
    """Each stack's KV summary (under its name, as `kv`), KV bytes moved per request with prefix-aware
    transfer over without it, the cut, and whether every turn's answer was the same on both stacks."""
    kv = {name: kv_summary(runs[name].kv) for name in PREFIX_STACKS}
    moved = ratio(*(kv[name]["bytes_pulled_per_request"] for name in PREFIX_STACKS))
    texts = [[r.text for r in runs[name].results] for name in PREFIX_STACKS]
    return {"kv_bytes_per_request_ratio": moved, "kv_bytes_cut": None if moved is None else 1.0 - moved,
            "same_answers": texts[0] == texts[1], "kv": kv}


def format_kv_table(report: Mapping[str, Any]) -> str:
    """The per-request KV numbers of each stack side by side, then the ratio and the cut."""
    rows = [("requests", "pulls", "{:.0f}"), ("KV bytes moved / request", "bytes_pulled_per_request", "{:,.0f}"),
            ("KV bytes skipped / request", "bytes_skipped_per_request", "{:,.0f}"),
            ("KV blocks moved / request", "blocks_pulled_per_request", "{:.2f}"),
            ("KV blocks skipped / request", "blocks_skipped_per_request", "{:.2f}")]
    kv = report["kv"]
    lines = [f"{'':<30}" + "".join(f"{name:>16}" for name in kv)]
    for label, key, fmt in rows:
        cells = ["-" if s[key] is None else fmt.format(s[key]) for s in kv.values()]
        lines.append(f"{label:<30}" + "".join(f"{c:>16}" for c in cells))
    moved, cut = report["kv_bytes_per_request_ratio"], report["kv_bytes_cut"]
    lines.append(f"KV bytes moved per request, on / off: {'-' if moved is None else f'{moved:.3f}'} "
                 f"(cut {'-' if cut is None else f'{cut:.1%}'}); same answers: {report['same_answers']}")
    return "\n".join(lines)
