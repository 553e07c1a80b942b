"""Open-loop serving benchmark: DI 1P1D vs colocated workers on the same cores, or DI over shm vs tcp.

    python -m benchmarks.bench_serving --target http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    python -m benchmarks.bench_serving --compare --json out/serving.json     # PNG next to it
    python -m benchmarks.bench_serving --compare --quick
    python -m benchmarks.bench_serving --compare-transports --json out/transports.json
    python -m benchmarks.bench_serving --workload multiturn --json out/multiturn.json
    python -m benchmarks.bench_serving --compare-conditional --json out/conditional.json
    python -m benchmarks.bench_serving --compare-tracing --quick     # tracing off vs on (feature_overhead.py)
    python -m benchmarks.bench_serving --compare-integrity --quick   # KV checksums off vs on

Sends synthetic prompts (token ids, fixed seed) as streamed completions with Poisson arrivals
(or all at once) and an optional concurrency cap; reports TTFT, TPOT, ITL and end-to-end
latency (mean, p50, p90, p99), request and output-token throughput, and goodput under a TTFT
and ITL SLO (a request's largest ITL is judged). `--compare` starts (a) a prefill worker and
a decode worker behind the proxy in DI mode and (b) two `both` workers behind the proxy in
colocated mode, one after the other, each worker pinned to its own core with one torch
thread, runs the same load against each, and reports DI over colocated ratios.
`--compare-transports` starts the DI stack twice, moving KV over shm and then over tcp, and runs
the same load against each: by default 200 streamed requests, 8 in flight, prompts of 10-800
tokens, 1-32 out (`--quick`: 24 requests); it reports tcp over shm ratios. `--cores none --threads 2`
runs the workers as examples/launch_1p1d.sh does on a 2-core host: not pinned, torch's default threads.
`--workload multiturn` sends chats instead (benchmarks/multiturn_load.py: `--conversations` x `--turns`,
each turn's prompt the previous turn's prompt + answer + new user text, `--max-concurrency`
conversations at once); alone it starts the DI stack with prefix-aware transfer on, then off
(`--no-prefix-aware-transfer` on the decode worker), and reports the KV bytes the decode worker
pulled per request in each and their ratio (benchmarks/prefix_compare.py); with `--target` it only
runs the chats against that endpoint.
`--compare-tracing` and `--compare-integrity` run two DI stacks, the feature off and on, in alternating rounds
(benchmarks/feature_overhead.py).
`--compare-conditional` runs the mixed workload of serving_mixed.py (short chat turns and long
documents) against conditional disaggregation, always-disaggregate and colocated stacks at rising
rates (default the ~24M benchmark model) and reports each one's goodput and conditional's ratios.
JSON (`--json`): `config` (every option and the command line that reproduces the run), then
`target`, or `di`, `colocated`, `itl_p99_ratio` and `ttft_p50_ratio` (DI over colocated), or
`shm`, `tcp`, `tcp_ttft_p50_ratio` and `tcp_e2e_p50_ratio` (tcp over shm), or `prefix_aware`,
`full_transfer` (each with `kv`: the decode worker's KV counts and their per-request values),
`kv_bytes_per_request_ratio` (on over off), `kv_bytes_cut` and `same_answers`, or `slo`, `workload`,
`systems` (per system its `rates` and `goodput_rps`; `paths` for conditional) and `ratios`, or `untraced`,
`traced` and `traced_*_throughput_ratio`, or `unchecked`, `checked`, `checked_e2e_p50_ratio` and
`checked_request_throughput_ratio` (on over off).
Exit status: 0 all requests answered, 1 a stack or the endpoint could not be used, 2 bad
arguments, 3 some requests failed (they are counted and their errors listed).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from benchmarks.bench_cli import fill_defaults, interrupted, parse_systems, stop_on_sigterm, write_json
from benchmarks.multiturn_load import MultiturnSpec, run_multiturn
from benchmarks.prefix_compare import PrefixRun, format_kv_table, prefix_report, run_prefix_stacks
from benchmarks.serving_load import LoadError, LoadSpec, SyntheticRequest, fetch_model, make_requests, run_load, warm_up
from benchmarks.serving_metrics import SLO, RequestResult, ratio, summarize
from benchmarks.serving_mixed import MIXED_DEFAULTS, MIXED_SYSTEMS, MixedWorkload, mixed_ratios, mixed_starters, mixed_sweep
from benchmarks.sweep_rules import parse_rates
from benchmarks.feature_overhead import OVERHEAD_DEFAULTS, OVERHEAD_RATIOS, overhead_ratios, run_overhead_compare
from benchmarks.serving_report import format_sweep_summary, format_sweep_system, format_table, plot_distributions, plot_sweep
from stack.serving import StackError, StackOptions, start_colocated, start_di

# Unset flags take these values; --quick picks the second set (both stacks in well under a minute).
DEFAULTS = {"num_prompts": (64, 12), "request_rate": (4.0, 6.0), "input_len_min": (64, 32),
            "input_len_max": (512, 192), "output_len_min": (16, 8), "output_len_max": (64, 24)}
# --compare-transports: a closed loop of 8 clients, the load the serving stack meets in the soak.
TRANSPORT_DEFAULTS = {"num_prompts": (200, 24), "request_rate": (math.inf, math.inf), "max_concurrency": (8, 8),
                      "input_len_min": (10, 10), "input_len_max": (800, 800), "output_len_min": (1, 1),
                      "output_len_max": (32, 32)}
RATIOS = {"itl_p99_ratio": ("itl_ms", "p99"), "ttft_p50_ratio": ("ttft_ms", "p50")}  # DI over colocated
TRANSPORT_RATIOS = {"tcp_ttft_p50_ratio": ("ttft_ms", "p50"), "tcp_e2e_p50_ratio": ("e2e_ms", "p50")}  # tcp over shm
TRANSPORTS = ("shm", "tcp")
# --workload multiturn: 16 chats of 6 turns, 4 at once (--quick: 4 of 3).
MULTITURN_DEFAULTS = {"conversations": (16, 4), "turns": (6, 3), "max_concurrency": (4, 4)}
MODES = ("--target, --compare, --compare-transports, --compare-conditional, --compare-tracing, --compare-integrity "
         "or --workload multiturn")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_serving.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--target", metavar="URL", help="benchmark an OpenAI endpoint that is already running")
    what.add_argument("--compare", action="store_true", help="start DI 1P1D and colocated stacks and compare them")
    what.add_argument("--compare-transports", action="store_true",
                      help="start the DI 1P1D stack over shm, then over tcp, and compare them")
    what.add_argument("--compare-tracing", action="store_true",
                      help="the DI stack untraced and traced (OTLP), same load in alternating rounds")
    what.add_argument("--compare-integrity", action="store_true",
                      help="the DI stack with KV checksums off and on (the default), same load in alternating rounds")
    what.add_argument("--compare-conditional", action="store_true",
                      help="the mixed workload against conditional disaggregation, always-disaggregate and colocated")
    load = p.add_argument_group("load")
    load.add_argument("--num-prompts", type=int)
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second; inf: all at once")
    load.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    for name in ("input-len-min", "input-len-max", "output-len-min", "output-len-max"):
        load.add_argument(f"--{name}", type=int)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--workload", choices=("synthetic", "multiturn"), default="synthetic",
                      help="synthetic: independent random prompts; multiturn: chats resending their history")
    load.add_argument("--conversations", type=int, help="multiturn: conversations (default 16, --quick 4)")
    load.add_argument("--turns", type=int, help="multiturn: turns of each conversation (default 6, --quick 3)")
    load.add_argument("--warmup", type=int, default=2, help="short unmeasured requests first (one per worker)")
    load.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one whole request")
    load.add_argument("--model-name", help="model field of the requests (default: the endpoint's first model)")
    slo = p.add_argument_group("goodput SLO")
    slo.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    slo.add_argument("--slo-itl-ms", type=float, default=200.0, help="judged on each request's largest ITL")
    mixed = p.add_argument_group("--compare-conditional")
    mixed.add_argument("--rates", help=f"rising requests/s (default {MIXED_DEFAULTS['rates'][0]})")
    mixed.add_argument("--seconds-per-rate", type=float, help="arrivals span about this long at each rate")
    mixed.add_argument("--systems", default=",".join(MIXED_SYSTEMS), help=f"a subset of {','.join(MIXED_SYSTEMS)}")
    mixed.add_argument("--max-local-prefill-tokens", type=int, help="the conditional proxy's threshold (default: its own)")
    mixed.add_argument("--max-prefill-queue", type=int, help="the conditional proxy's threshold (default: its own)")
    mixed.add_argument("--ours-extra", default="", help="more flags for every worker, e.g. --ours-extra=\"--max-num-batched-tokens 128\"")
    mixed.add_argument("--goodput-attainment", type=float, default=0.9, help="share meeting the SLO for goodput")
    mixed.add_argument("--stop-attainment", type=float, default=0.5, help="stop a stack after two rates below this")
    mixed.add_argument("--stall-factor", type=float, default=3.0, help="a stall: an ITL over this x the median ITL")
    stack = p.add_argument_group("stacks (--compare)")
    stack.add_argument("--model", help="model directory for the workers (default: the built-in model)")
    stack.add_argument("--cores", help="two CPU cores for the two workers, e.g. 0,1 (default: the first two usable); "
                                       "none: not pinned")
    stack.add_argument("--threads", type=int, default=1, help="torch threads of every worker (default 1)")
    stack.add_argument("--kv-transport", default="shm", help="DI KV transport (--compare)")
    stack.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for a stack to come up")
    out = p.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    out.add_argument("--plot", type=Path, metavar="PATH", help="PNG of ITL and TTFT CDFs (default: next to --json)")
    out.add_argument("--quick", action="store_true", help="a small sub-minute run")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    multiturn = args.workload == "multiturn"
    overhead = args.compare_tracing or args.compare_integrity
    if multiturn and (args.compare or args.compare_transports or args.compare_conditional or overhead):
        parser.error("--workload multiturn runs against --target or on its own DI stacks, not with --compare*")
    if not (multiturn or args.target or args.compare or args.compare_transports or args.compare_conditional
            or overhead):
        parser.error(f"choose one of {MODES}")
    fill_defaults(args, {**DEFAULTS, **(TRANSPORT_DEFAULTS if args.compare_transports else {}),
                         **(MULTITURN_DEFAULTS if multiturn else {}), **(OVERHEAD_DEFAULTS if overhead else {}),
                         **(MIXED_DEFAULTS if args.compare_conditional else {})})
    try:
        args.multiturn = multiturn_spec(args) if multiturn else None
        if args.compare_conditional:
            args.rates = parse_rates(args.rates)
            args.systems = parse_systems(parser, args.systems, MIXED_SYSTEMS)
            args.ours_extra = shlex.split(args.ours_extra)
            args.mixed = MixedWorkload()
        args.spec = LoadSpec(args.num_prompts, (args.input_len_min, args.input_len_max),
                             (args.output_len_min, args.output_len_max), args.request_rate,
                             args.max_concurrency, args.seed, args.request_timeout)
        args.core_pair = core_pair(args.cores) if not args.target else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.plot is None and args.json is not None:
        args.plot = args.json.with_suffix(".png")
    return args


def multiturn_spec(args: argparse.Namespace) -> MultiturnSpec:
    """The chats --workload multiturn sends; ValueError for bad counts."""
    return MultiturnSpec(args.conversations, args.turns, output_len=(args.output_len_min, args.output_len_max),
                         max_concurrency=args.max_concurrency, seed=args.seed, request_timeout_s=args.request_timeout)


def core_pair(text: str | None) -> tuple[int | None, int | None]:
    """Two different usable cores from "A,B" (default: the first two usable), or "none" for
    unpinned workers; ValueError otherwise."""
    if text == "none":
        return None, None
    usable = sorted(os.sched_getaffinity(0))
    cores = [int(c) for c in text.split(",")] if text else usable[:2]
    if len(cores) != 2 or cores[0] == cores[1] or not set(cores) <= set(usable):
        raise ValueError(f"need two different usable cores (usable: {usable}), got {cores}")
    return cores[0], cores[1]


async def measure(url: str, args: argparse.Namespace,
                  requests: Sequence[SyntheticRequest]) -> tuple[list[RequestResult], float]:
    """Warms the endpoint up (unmeasured), then runs the load against it."""
    model = args.model_name or await fetch_model(url)
    if args.warmup:
        await warm_up(url, model, args.warmup, args.request_timeout)
    return await run_load(url, model, args.spec, requests)


def run(args: argparse.Namespace) -> dict[str, tuple[list[RequestResult], float]]:
    requests = make_requests(args.spec)
    if args.target:
        return {"target": asyncio.run(measure(args.target, args, requests))}
    options = StackOptions(args.core_pair, args.model, args.kv_transport, args.startup_timeout, threads=args.threads)
    stacks = [("di", start_di, options), ("colocated", start_colocated, options)]
    if args.compare_tracing or args.compare_integrity:
        feature = "tracing" if args.compare_tracing else "integrity"
        runs, spans = run_overhead_compare(feature, args, requests, options, measure)
        if spans is not None:
            args.spans_received = spans
        return runs
    if args.compare_transports:
        stacks = [(name, start_di, replace(options, kv_transport=name)) for name in TRANSPORTS]
    runs: dict[str, tuple[list[RequestResult], float]] = {}
    for name, start, stack_options in stacks:
        print(f"starting the {name} stack ...", file=sys.stderr, flush=True)
        with start(stack_options) as stack:
            runs[name] = asyncio.run(measure(stack.url, args, requests))
    return runs


def run_multiturn_workload(args: argparse.Namespace) -> dict[str, PrefixRun]:
    """The chats against --target, or on the DI stack with prefix-aware transfer on and then off."""
    if args.target:
        async def target() -> PrefixRun:
            model = args.model_name or await fetch_model(args.target)
            return PrefixRun(*await run_multiturn(args.target, model, args.multiturn), kv={})
        return {"target": asyncio.run(target())}
    options = StackOptions(args.core_pair, args.model, args.kv_transport, args.startup_timeout, threads=args.threads)
    return run_prefix_stacks(args.multiturn, options, args.warmup, args.model_name)


def report(args: argparse.Namespace, runs: dict[str, tuple[list[RequestResult], float]],
           argv: Sequence[str]) -> dict[str, Any]:
    """The JSON document: `config`, one summary per run (with its requests), DI-over-colocated or
    tcp-over-shm ratios."""
    slo = SLO(args.slo_ttft_ms, args.slo_itl_ms)
    summaries = {name: summarize(results, duration, slo) for name, (results, duration) in runs.items()}
    ratios = {}
    for (top, bottom), table in ((("di", "colocated"), RATIOS), (TRANSPORTS[::-1], TRANSPORT_RATIOS)):
        if top in summaries:
            ratios.update({name: ratio(summaries[top][key][stat], summaries[bottom][key][stat])
                           for name, (key, stat) in table.items()})
    ratios.update(overhead_ratios(summaries))
    config = {k: json_value(v) for k, v in vars(args).items() if k not in ("spec", "multiturn", "spans_received")}
    config["command"] = shlex.join(["python", "-m", "benchmarks.bench_serving", *argv])
    out: dict[str, Any] = {"config": config, **ratios}
    if hasattr(args, "spans_received"):  # --compare-tracing: what the traced stack exported
        out["spans_received"] = args.spans_received
    for name, (results, _) in runs.items():
        out[name] = {**summaries[name], "requests": [_request_record(r) for r in results]}
    return out


def _request_record(r: RequestResult) -> dict[str, Any]:
    ok = r.ok
    return {"input_tokens": r.input_tokens, "expected_output_tokens": r.expected_output_tokens,
            "output_tokens": r.output_tokens, "ttft_ms": r.ttft * 1e3 if ok else None,
            "e2e_ms": r.e2e * 1e3, "itl_ms": [gap * 1e3 for gap in r.itls], "error": r.error}


def run_conditional(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """--compare-conditional: each stack swept in turn, then goodputs and ratios printed and written."""
    from worker.model.bench_model import create_bench_model  # torch: only once the command line is good

    model_dir = str(Path(args.model).resolve()) if args.model else str(create_bench_model())
    slo = SLO(args.slo_ttft_ms, args.slo_itl_ms)
    systems = {}
    try:
        for name, start in mixed_starters(args, model_dir).items():
            if name not in args.systems:
                continue
            print(f"starting the {name} stack ...", file=sys.stderr, flush=True)
            with start() as stack:
                systems[name] = mixed_sweep(name, stack, args, slo)
    except (StackError, LoadError) as exc:
        print(f"bench_serving.py: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted("bench_serving.py")
    slo_record = {"ttft_ms": slo.ttft_ms, "largest_gap_ms": slo.itl_ms, "attainment_for_goodput": args.goodput_attainment}
    config = {k: json_value(v) for k, v in vars(args).items() if k not in ("spec", "mixed", "multiturn")}
    config["command"] = shlex.join(["python", "-m", "benchmarks.bench_serving", *argv])
    out = {"config": config, "slo": slo_record, "workload": asdict(args.mixed), "systems": systems,
           "ratios": mixed_ratios(systems)}
    for name, system in systems.items():
        print(format_sweep_system(name, system["rates"]) + "\n")
    print(format_sweep_summary(systems, out["ratios"], f"TTFT <= {slo.ttft_ms:g} ms and largest gap <= "
                               f"{slo.itl_ms:g} ms; goodput: highest rate with >= {args.goodput_attainment:.0%} meeting it"))
    print(f"conditional paths: {systems.get('conditional', {}).get('paths')}")
    write_json(args.json, out)
    if args.plot is not None:
        problem = plot_sweep({n: s["rates"] for n, s in systems.items()}, slo_record, args.plot)
        print(problem or f"wrote {args.plot}")
    return 0 if all(p["failed"] == 0 for s in systems.values() for p in s["rates"]) else 3


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    stop_on_sigterm()
    if args.compare_conditional:
        return run_conditional(args, argv)
    prefix_runs: dict[str, PrefixRun] = {}
    try:
        if args.multiturn:
            prefix_runs = run_multiturn_workload(args)
            runs = {name: (run.results, run.duration_s) for name, run in prefix_runs.items()}
        else:
            runs = run(args)
    except (StackError, LoadError) as exc:
        print(f"bench_serving.py: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted("bench_serving.py")
    out = report(args, runs, argv)
    print(format_table({name: out[name] for name in runs}, {k: out[k] for k in (*RATIOS, *TRANSPORT_RATIOS, *OVERHEAD_RATIOS) if k in out}))
    if args.multiturn and not args.target:
        prefix = prefix_report(prefix_runs)
        for name, kv in prefix.pop("kv").items():
            out[name]["kv"] = kv
        out.update(prefix)
        print(format_kv_table({**prefix, "kv": {name: out[name]["kv"] for name in prefix_runs}}))
    for name in runs:
        for error in out[name]["errors"]:
            print(f"{name}: failed: {error}")
    write_json(args.json, out)
    if args.plot is not None:
        problem = plot_distributions({name: results for name, (results, _) in runs.items()}, args.plot)
        print(problem or f"wrote {args.plot}")
    return 0 if all(s["failed"] == 0 for s in (out[n] for n in runs)) else 3


def json_value(value: object) -> object:
    """A config value as strict JSON: paths as strings, an infinite rate as "inf"."""
    if isinstance(value, Path) or (isinstance(value, float) and math.isinf(value)):
        return str(value)
    return value


if __name__ == "__main__":
    sys.exit(main())
