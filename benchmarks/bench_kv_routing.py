"""KV-aware routing against round-robin on multi-turn chats that share system prompts, over 1P2D and 2P2D.

    python -m benchmarks.bench_kv_routing --json benchmarks/results/kv_routing.json     # PNG next to it
    python -m benchmarks.bench_kv_routing --quick
    python -m benchmarks.bench_kv_routing --trace mooncake_trace.jsonl --trace-scale 8
    python -m benchmarks.bench_kv_routing --topologies 2p2d --session-rate 0.8,1.0 --closed-loop   # open loop too

For each topology and each routing (`--routing round_robin`, `--routing kv`) it starts the static xPyD
stack (stack/xpyd.py: every worker publishes KV cache events) and sends the same load: chats from
benchmarks/multiturn_load.py (`--conversations` x `--turns`, `--system-prompts` shared system texts,
`--max-concurrency` chats at once, each starting as another ends: a closed loop; sent as /v1/chat/completions
messages, or with `--api completions` as text prompts), or a Mooncake-format
trace (benchmarks/mooncake_trace.py; `--trace` a file, or `--synthetic-trace` one of our own). Workers are our engine, by default simulated (`--engine
mock`: the real scheduler, prefix cache and KV transfer, the forward pass replaced by the cost model
calibrated on this machine), so four workers and the proxy fit two cores; `--engine model` computes.
A closed loop sends a faster stack more requests per second; `--session-rate R[,R...]` runs the chats open
loop as well (or instead: `--no-closed-loop`): R chats start per second per prefill worker at Poisson times
(the same for both routings), each turn `--think-time` seconds after the last answer, so both routings
face the same load. `--conditional-disaggregation` turns it on in both proxies (a decode worker that holds all
but a short part of a prompt prefills it itself).
`--kv-write-back MODE` starts every worker with it (the workers' default is `chats`): a finished answer's KV
goes back to the prefill worker that served its prompt, so a next turn sent there computes only its new message.
It reports TTFT/TPOT/ITL per run, from the KV-routed proxy's counters the prompt tokens its picked
prefill worker held (`hit`) and the most any prefill worker held (`best`), and what TTFT is made of
(`ttft_split`, benchmarks/ttft_split.py: the proxy, the leg's trip, the prefill workers' queue and compute,
each worker's share of prompt tokens computed and of time busy). JSON `ratios`:
`kv_over_round_robin_ttft_p50` (the largest topology's, open loop at the first rate when there is one),
`closed_loop_kv_over_round_robin_ttft_p50`, per topology `<topo>_kv_over_round_robin_ttft_p50` (closed loop)
and `<topo>_open<R>_kv_over_round_robin_ttft_p50`, and `prefix_hit_share` (hit / best over the KV-routed
runs). Exit status: 0 all answered, 1 a stack
failed, 2 bad arguments, 3 some requests failed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import sys
import time
from pathlib import Path
from dataclasses import replace
from typing import Any, Sequence

import httpx

from benchmarks import ttft_split
from benchmarks.bench_cli import write_json
from benchmarks.mooncake_trace import load_trace, run_trace, synthetic_trace
from benchmarks.multiturn_load import APIS, MultiturnSpec, run_multiturn
from benchmarks.serving_load import fetch_model, warm_up
from benchmarks.serving_metrics import SLO, RequestResult, ratio, summarize
from benchmarks.serving_report import format_table, plot_distributions
from stack.serving import Stack, StackError, StackOptions
from stack.xpyd import start_xpyd
from worker.config import DEFAULT_WRITE_BACK, WRITE_BACK_MODES

TOPOLOGIES = {"1p2d": (1, 2), "2p2d": (2, 2)}
ROUTINGS = ("round_robin", "kv")
MOCK = ("--engine", "mock")
HEADLINE_CLOSED = "closed loop (--max-concurrency chats at once)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv_routing", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the report here (and the PNG next to it)")
    p.add_argument("--quick", action="store_true", help="a short run: 8 chats of 3 turns, 2P2D only")
    p.add_argument("--topologies", default=None, help="comma-separated of 1p2d,2p2d (default both)")
    p.add_argument("--engine", choices=("mock", "model"), default="mock", help="simulated or computing workers")
    p.add_argument("--conversations", type=int, default=None, help="chats (default 48, --quick 8)")
    p.add_argument("--turns", type=int, default=None, help="turns per chat (default 6, --quick 3)")
    p.add_argument("--system-prompts", type=int, default=4, help="shared system texts (default 4)")
    p.add_argument("--system-chars", type=int, default=600, help="length of each system text (default 600)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="chats at once in the closed loop (default 12, --quick 4)")
    p.add_argument("--session-rate", default=None, metavar="R[,R...]",
                   help="open loop: chats started per second per prefill worker (Poisson, --seed); several rates "
                        "comma-separated, the first one's ratio is the headline")
    p.add_argument("--think-time", type=float, default=0.0, help="open loop: seconds between an answer and the "
                                                                 "chat's next turn (default 0)")
    p.add_argument("--api", choices=APIS, default="chat",
                   help="chats as chat-completion messages (default), or as text prompts to /v1/completions")
    p.add_argument("--closed-loop", action=argparse.BooleanOptionalAction, default=None,
                   help="run the closed loop too (default: only when no --session-rate is given)")
    p.add_argument("--trace", type=Path, help="replay this Mooncake-format trace instead of chats")
    p.add_argument("--synthetic-trace", type=int, metavar="N", help="replay N requests of a generated trace")
    p.add_argument("--trace-scale", type=int, default=8, help="divide trace lengths and blocks by this (default 8)")
    p.add_argument("--time-scale", type=float, default=1.0, help="stretch trace arrival times (default 1)")
    p.add_argument("--kv-load-tokens", type=int, default=None, metavar="N",
                   help="the KV-routed proxy's --kv-load-tokens (default: the proxy's own)")
    p.add_argument("--kv-load-queued-tokens", action=argparse.BooleanOptionalAction, default=None,
                   help="the KV-routed proxy's --[no-]kv-load-queued-tokens (default: the proxy's own)")
    p.add_argument("--conditional-disaggregation", action="store_true",
                   help="both proxies run conditional disaggregation (a decode worker prefills a prompt whose "
                        "uncached part is short itself); KV routing weighs it with the index, round-robin with "
                        "the proxy's own estimate")
    p.add_argument("--kv-write-back", default=DEFAULT_WRITE_BACK, choices=WRITE_BACK_MODES,
                   help="every worker with --kv-write-back MODE, under both routings: which finished answers' KV a "
                        "decode worker gives back to the prefill worker that served its prompt (default: the "
                        f"workers' own, {DEFAULT_WRITE_BACK})")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per stack (default 2)")
    p.add_argument("--seed", type=int, default=0)
    return p


def stack_options(args: argparse.Namespace, routing: str) -> StackOptions:
    proxy = ["--routing", "kv"] if routing == "kv" else []
    if routing == "kv" or args.conditional_disaggregation:
        proxy += ["--tokenizer", "builtin"]
    if args.conditional_disaggregation:
        proxy += ["--conditional-disaggregation"]
    if routing == "kv" and args.kv_load_tokens is not None:
        proxy += ["--kv-load-tokens", str(args.kv_load_tokens)]
    if routing == "kv" and args.kv_load_queued_tokens is not None:
        proxy += ["--kv-load-queued-tokens" if args.kv_load_queued_tokens else "--no-kv-load-queued-tokens"]
    workers = (MOCK if args.engine == "mock" else ()) + ("--kv-write-back", args.kv_write_back)
    return StackOptions(cores=(0, 1), worker_extra=workers,
                        startup_timeout_s=300.0, proxy_extra=tuple(proxy))


def route_counts(url: str) -> dict[str, float]:
    """The KV-routed proxy's prompt / hit / best token counters (zeros for round-robin)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = dict(re.findall(r'^proxy_kv_route_tokens_total\{kind="(\w+)"\} ([0-9.e+]+)$', text, re.M))
    return {kind: float(found.get(kind, 0.0)) for kind in ("prompt", "hit", "best")}


async def _measure(stack: Stack, args: argparse.Namespace) -> tuple[list[RequestResult], float, dict[str, Any]]:
    url = stack.url
    model = await fetch_model(url)
    if args.warmup:
        await warm_up(url, model, args.warmup)
    before, workers_before, since = route_counts(url), ttft_split.counters(stack.worker_urls), time.time()
    if args.rows is not None:
        results, duration = await run_trace(url, model, args.rows, scale=args.trace_scale, time_scale=args.time_scale)
    else:
        results, duration = await run_multiturn(url, model, args.spec)
    after = route_counts(url)
    split = ttft_split.split(ttft_split.timelines(stack.timeline_urls(), since), workers_before,
                             ttft_split.counters(stack.worker_urls), duration)
    offered = ({"loop": "closed", "max_concurrency": args.spec.max_concurrency} if args.spec.session_rate is None else
               {"loop": "open", "chats_per_s": args.spec.session_rate, "think_time_s": args.spec.think_time_s})
    return results, duration, {**{k: after[k] - before[k] for k in after}, "ttft_split": split,
                               "offered_load": {"loop": "trace"} if args.rows is not None else offered}


def load_name(topo: str, rate: float | None) -> str:
    """A topology's closed loop (`2p2d`) or its open loop at `rate` chats/s per prefill worker (`2p2d_open1`)."""
    return topo if rate is None else f"{topo}_open{rate:g}"


def run_all(args: argparse.Namespace) -> dict[str, tuple[list[RequestResult], float, dict[str, float]]]:
    runs = {}
    for topo in args.topologies:
        for rate in args.loads:
            spec = args.spec if rate is None else replace(args.spec, session_rate=rate * TOPOLOGIES[topo][0],
                                                          think_time_s=args.think_time)
            for routing in ROUTINGS:
                name = f"{load_name(topo, rate)}_{routing}"
                print(f"starting {name} ...", file=sys.stderr, flush=True)
                with start_xpyd(stack_options(args, routing), *TOPOLOGIES[topo]) as stack:
                    runs[name] = asyncio.run(_measure(stack, replace_spec(args, spec)))
    return runs


def replace_spec(args: argparse.Namespace, spec: MultiturnSpec) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "spec": spec})


def report(args: argparse.Namespace, runs: dict[str, Any], argv: Sequence[str],
           load: tuple[float, ...], load_after: tuple[float, ...]) -> dict[str, Any]:
    slo = SLO(2000.0, 200.0)
    summaries = {name: summarize(results, duration, slo) for name, (results, duration, _) in runs.items()}
    ratios: dict[str, float | None] = {}
    for topo in args.topologies:
        for rate in args.loads:
            group = load_name(topo, rate)
            ratios[f"{group}_kv_over_round_robin_ttft_p50"] = ratio(summaries[f"{group}_kv"]["ttft_ms"]["p50"],
                                                                    summaries[f"{group}_round_robin"]["ttft_ms"]["p50"])
    largest = args.topologies[-1]
    headline = next((rate for rate in args.loads if rate is not None), None)
    if None in args.loads:
        ratios["closed_loop_kv_over_round_robin_ttft_p50"] = ratios[f"{largest}_kv_over_round_robin_ttft_p50"]
    ratios["kv_over_round_robin_ttft_p50"] = ratios[f"{load_name(largest, headline)}_kv_over_round_robin_ttft_p50"]
    hit = sum(counts["hit"] for name, (_, _, counts) in runs.items() if name.endswith("_kv"))
    best = sum(counts["best"] for name, (_, _, counts) in runs.items() if name.endswith("_kv"))
    ratios["prefix_hit_share"] = ratio(hit, best)
    config = {k: v for k, v in vars(args).items() if k not in ("spec", "rows", "json", "trace", "loads")}
    config.update(command=shlex.join(["python", "-m", "benchmarks.bench_kv_routing", *argv]),
                  headline=HEADLINE_CLOSED if headline is None else
                  f"open loop, {headline:g} chats/s per prefill worker, {largest}",
                  trace=str(args.trace) if args.trace else None, load_average_before=load, load_average_after=load_after)
    out: dict[str, Any] = {"config": config, "ratios": ratios, "goals": {"kv_over_round_robin_ttft_p50": "<= 0.5",
                                                                        "prefix_hit_share": ">= 0.9"}}
    for name, (results, _, counts) in runs.items():
        out[name] = {**summaries[name], "route_tokens": {k: counts[k] for k in ("prompt", "hit", "best")},
                     "ttft_split": counts["ttft_split"], "offered_load": counts["offered_load"]}
    return out


def loads(session_rate: str | None, closed_loop: bool | None) -> list[float | None]:
    """The loads to run: the closed loop (None) if asked, then the open-loop rates (per prefill worker)."""
    bad = ValueError(f"--session-rate: positive chats/s per prefill worker, comma-separated, got {session_rate!r}")
    try:
        rates = [float(r) for r in session_rate.split(",") if r.strip()] if session_rate is not None else []
    except ValueError:
        raise bad from None
    if any(not r > 0 for r in rates) or (session_rate is not None and not rates):
        raise bad
    closed = not rates if closed_loop is None else closed_loop
    if not closed and not rates:
        raise ValueError("--no-closed-loop needs --session-rate")
    return [None] * closed + rates


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    topologies = args.topologies or ("2p2d" if args.quick else "1p2d,2p2d")
    args.topologies = [t for t in topologies.split(",") if t]
    if any(t not in TOPOLOGIES for t in args.topologies):
        parser.error(f"--topologies: each one of {', '.join(TOPOLOGIES)}")
    try:
        args.loads = loads(args.session_rate, args.closed_loop)
    except ValueError as exc:
        parser.error(str(exc))
    if args.think_time < 0:
        parser.error("--think-time must be at least 0")
    if args.session_rate and (args.trace or args.synthetic_trace):
        parser.error("--session-rate runs chats; a trace brings its own arrival times")
    try:
        args.spec = MultiturnSpec(args.conversations or (8 if args.quick else 48), args.turns or (3 if args.quick else 6),
                                  system_chars=args.system_chars, opening_chars=(100, 200), user_chars=(40, 100),
                                  output_len=(16, 32), max_concurrency=args.max_concurrency or (4 if args.quick else 12),
                                  seed=args.seed, num_system_prompts=args.system_prompts, api=args.api)
        args.rows = (load_trace(args.trace) if args.trace else
                     synthetic_trace(args.synthetic_trace, 2.0, 4, 2, (2, 3), 128, args.seed)
                     if args.synthetic_trace else None)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    load = os.getloadavg()
    try:
        runs = run_all(args)
    except StackError as exc:
        print(f"a stack failed: {exc}", file=sys.stderr)
        return 1
    out = report(args, runs, argv, load, os.getloadavg())
    for group in (load_name(topo, rate) for topo in args.topologies for rate in args.loads):
        print(f"\n{group}\n" + format_table({r: out[f"{group}_{r}"] for r in ROUTINGS},
                           {"kv / round_robin TTFT p50": out["ratios"][f"{group}_kv_over_round_robin_ttft_p50"]}))
    print("\n".join(f"{k}: {'-' if v is None else f'{v:.3f}'}" for k, v in out["ratios"].items()))
    for name in runs:
        print(ttft_split.describe(name, out[name]["ttft_split"]))
    if args.json is not None:
        write_json(args.json, out)
        largest = args.topologies[-1] + "_"   # its curves alone: the ratios are the largest topology's
        plot_distributions({name: results for name, (results, _, _) in runs.items() if name.startswith(largest)},
                           args.json.with_suffix(".png"))
    failed = sum(not r.ok for results, _, _ in runs.values() for r in results)
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
