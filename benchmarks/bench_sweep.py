"""Serving sweep: goodput, latency and stalls of each system under a rising open-loop request rate.

    python -m benchmarks.bench_sweep --json benchmarks/results/sweep.json      # PNG next to it
    python -m benchmarks.bench_sweep --quick --systems di_1p1d,colocated
    python -m benchmarks.bench_sweep --rates 0.5,1,1.5 --ours-extra="--max-num-seqs 8"

Systems, each on the same two cores, one worker or server per core:
  di_1p1d         our prefill worker and decode worker behind our proxy (DI)
  colocated       two of our `both` workers behind our proxy, round-robin
  vllm_colocated  two plain `vllm serve` behind our proxy, round-robin
  vllm_nixl       vLLM 1P1D with vLLM's NixlConnector (skipped where `import nixl` fails)
  vllm_neuron     vLLM 1P1D with our NeuronConnector
Each stack is started once, warmed up, loaded at every rate in turn (rising), and stopped. The
load is the same for every system: the ~24M benchmark model, prompts of 256-1536 random tokens,
128 output tokens each (max_tokens with ignore_eos), Poisson arrivals, the same seed. A system
stops early once two rates in a row had under 50% SLO attainment; one that cannot start is
skipped with the reason and the others still run.
Per rate: TTFT p50/p99, ITL p50/p99, TPOT p99, each request's largest gap (p50/p99 over
requests), stalls per request (ITLs over 3x the run's median ITL), the mean number of requests
in flight and SLO attainment (share of requests with TTFT and largest gap within the SLO).
Per system: goodput, the highest rate at which at least 90% of requests met the SLO, and the
stalls per request at the rate whose mean running batch is closest to 8, the batch estimated as the
requests in flight over the engines decoding them (2 for the colocated systems, else 1).
JSON (`--json`): `config` (every option and the command line), `slo`, `systems` (per system its
`rates`, `goodput_rps`, `near_batch`, and `skipped` or `stopped_early` when so) and `ratios`
(DI goodput over each other system's, and vLLM 1P1D with NeuronConnector's over two colocated vLLM
servers'), and `loadavg` before and after the run. Exit status: 0 at least one system measured, 1 none,
2 bad arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.bench_serving import core_pair, json_value
from benchmarks.serving_load import LoadError, LoadSpec, fetch_model, make_requests, run_load, warm_up
from benchmarks.serving_metrics import SLO, ratio
from benchmarks.serving_report import format_sweep_summary, format_sweep_system, plot_sweep
from benchmarks.sweep_rules import goodput_rps, near_batch, parse_rates, rate_point, should_stop

from benchmarks.bench_cli import fill_defaults, interrupted, parse_systems, stop_on_sigterm, write_json
from stack.serving import Stack, StackError, StackOptions, start_colocated, start_di
from stack.vllm import VllmOptions, start_colocated_pair, start_neuron_1p1d, start_nixl_1p1d

SYSTEMS = ("di_1p1d", "colocated", "vllm_colocated", "vllm_nixl", "vllm_neuron")
DECODE_ENGINES = {"di_1p1d": 1, "colocated": 2, "vllm_colocated": 2, "vllm_nixl": 1, "vllm_neuron": 1}
# Goodput ratios: name -> (numerator system, denominator system).
RATIOS = {"di_over_vllm_colocated": ("di_1p1d", "vllm_colocated"), "di_over_vllm_nixl": ("di_1p1d", "vllm_nixl"),
          "di_over_colocated": ("di_1p1d", "colocated"),
          "vllm_neuron_over_vllm_colocated": ("vllm_neuron", "vllm_colocated")}
# Unset flags take these values; --quick picks the second.
# A prompt of 256-1536 tokens is 0.15-0.9 s of prefill on one core (~1850 tok/s for this model), so one
# prefill worker saturates below 2 req/s; measured here with the cores shared, DI and both colocated
# systems met the SLO for under a quarter of requests at 1-2 req/s. 3 and 4 leave room for faster systems.
DEFAULTS = {"rates": ("0.25,0.5,0.75,1,1.5,2,3,4", "0.25,0.5,1,2"), "seconds_per_rate": (60.0, 10.0),
            "min_prompts": (16, 6)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_sweep.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    load = p.add_argument_group("load")
    load.add_argument("--rates", help=f"rising requests/s (default {DEFAULTS['rates'][0]}; --quick {DEFAULTS['rates'][1]})")
    load.add_argument("--seconds-per-rate", type=float, help="arrivals span about this long at each rate "
                      f"(default {DEFAULTS['seconds_per_rate'][0]:g}; --quick {DEFAULTS['seconds_per_rate'][1]:g})")
    load.add_argument("--min-prompts", type=int, help="at least this many requests per rate "
                      f"(default {DEFAULTS['min_prompts'][0]}; --quick {DEFAULTS['min_prompts'][1]})")
    load.add_argument("--input-len-min", type=int, default=256)
    load.add_argument("--input-len-max", type=int, default=1536)
    load.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=8, help="unmeasured requests (4 output tokens) after a stack starts")
    load.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one whole request")
    judge = p.add_argument_group("SLO and rules")
    judge.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    judge.add_argument("--slo-gap-ms", type=float, default=100.0, help="a request's largest ITL at most this")
    judge.add_argument("--goodput-attainment", type=float, default=0.9, help="share meeting the SLO for goodput")
    judge.add_argument("--stop-attainment", type=float, default=0.5,
                       help="stop a system after two rates in a row below this share")
    judge.add_argument("--stall-factor", type=float, default=3.0, help="a stall: an ITL over this x the median ITL")
    judge.add_argument("--batch", type=float, default=8.0, help="report stalls at the rate whose running batch is nearest this")
    stack = p.add_argument_group("stacks")
    stack.add_argument("--model", help="model directory (default: the ~24M benchmark model)")
    stack.add_argument("--cores", help="two CPU cores, one per worker (default: the first two usable)")
    stack.add_argument("--kv-transport", default="shm", help="our DI workers' KV transport")
    stack.add_argument("--ours-extra", default="", help="more flags for every one of our workers, e.g. --ours-extra=\"--max-num-seqs 8\"")
    stack.add_argument("--max-model-len", type=int, default=2048, help="vLLM servers' context length")
    stack.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a stack to come up")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON, and the PNG next to it")
    p.add_argument("--quick", action="store_true", help="four rates, about 10 s of arrivals each")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    fill_defaults(args, DEFAULTS)
    args.systems = parse_systems(parser, args.systems, SYSTEMS)
    try:
        args.rates = parse_rates(args.rates)
        args.ours_extra = shlex.split(args.ours_extra)
        args.core_pair = core_pair(args.cores)
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 < args.stop_attainment <= args.goodput_attainment <= 1:
        parser.error("need 0 < --stop-attainment <= --goodput-attainment <= 1")
    if min(args.seconds_per_rate, args.min_prompts, args.stall_factor, args.slo_ttft_ms, args.slo_gap_ms) <= 0:
        parser.error("--seconds-per-rate, --min-prompts, --stall-factor and the SLO must be positive")
    if args.input_len_max + args.output_len > args.max_model_len:
        parser.error(f"--input-len-max + --output-len exceeds --max-model-len {args.max_model_len}")
    try:
        args.specs = [load_spec(args, i, rate) for i, rate in enumerate(args.rates)]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def load_spec(args: argparse.Namespace, index: int, rate: float) -> LoadSpec:
    """The load at the `index`-th rate: arrivals spanning about --seconds-per-rate, at least --min-prompts.
    Each rate has prompts of its own (its own seed), so no rate finds the last one's in a prefix cache."""
    num = max(args.min_prompts, math.ceil(rate * args.seconds_per_rate))
    return LoadSpec(num, (args.input_len_min, args.input_len_max), (args.output_len, args.output_len), rate,
                    seed=args.seed + 1000 * index, request_timeout_s=args.request_timeout)


def slo_of(args: argparse.Namespace) -> dict[str, float]:
    return {"ttft_ms": args.slo_ttft_ms, "largest_gap_ms": args.slo_gap_ms,
            "attainment_for_goodput": args.goodput_attainment}


def starters(args: argparse.Namespace) -> dict[str, Callable[[], Stack]]:
    ours = StackOptions(cores=args.core_pair, model=args.model_dir, kv_transport=args.kv_transport,
                        startup_timeout_s=args.startup_timeout, worker_extra=tuple(args.ours_extra))
    vllm = VllmOptions(model=args.model_dir, cores=args.core_pair, max_model_len=args.max_model_len,
                       startup_timeout_s=args.startup_timeout)
    return {"di_1p1d": lambda: start_di(ours), "colocated": lambda: start_colocated(ours),
            "vllm_colocated": lambda: start_colocated_pair(vllm), "vllm_nixl": lambda: start_nixl_1p1d(vllm),
            "vllm_neuron": lambda: start_neuron_1p1d(vllm)}


def sweep(name: str, stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """Warms the stack up, then loads it at each rate in turn until the stop rule holds."""
    model = asyncio.run(fetch_model(stack.url))
    if args.warmup:
        # Prompts over the whole length range: the first prefill of a new length costs extra.
        asyncio.run(warm_up(stack.url, model, args.warmup, args.request_timeout,
                            (args.input_len_min, args.input_len_max)))
    slo, points, stopped = SLO(args.slo_ttft_ms, args.slo_gap_ms), [], None
    for rate, spec in zip(args.rates, args.specs):
        results, duration = asyncio.run(run_load(stack.url, model, spec, make_requests(spec)))
        points.append(rate_point(rate, results, duration, slo, args.stall_factor))
        print(f"{name}: {rate:g} req/s: {points[-1]['slo_attainment']:.0%} met the SLO, "
              f"{points[-1]['mean_in_flight']:.1f} in flight", file=sys.stderr, flush=True)
        if should_stop(points, args.stop_attainment) and rate != args.rates[-1]:
            stopped = (f"stopped after {rate:g} req/s: two rates in a row under "
                       f"{args.stop_attainment:.0%} attainment")
            print(f"{name}: {stopped}", file=sys.stderr, flush=True)
            break
    return system_record(name, points, args, stopped)


def system_record(name: str, points: list[dict[str, Any]], args: argparse.Namespace,
                  stopped: str | None) -> dict[str, Any]:
    record: dict[str, Any] = {"rates": points, "goodput_rps": goodput_rps(points, args.goodput_attainment),
                              "near_batch": near_batch(points, args.batch, DECODE_ENGINES[name])}
    if stopped:
        record["stopped_early"] = stopped
    return record


def skipped(reason: str) -> dict[str, Any]:
    return {"rates": [], "goodput_rps": None, "near_batch": None, "skipped": reason}


def run_system(name: str, start: Callable[[], Stack], args: argparse.Namespace) -> dict[str, Any]:
    """One system's sweep, or a skipped record saying why it could not be measured."""
    if name == "vllm_nixl":
        from benchmarks.bench_vllm import nixl_problem

        problem = nixl_problem()
        if problem:
            return skipped(problem)
    print(f"starting {name} ...", file=sys.stderr, flush=True)
    try:
        with start() as stack:
            return sweep(name, stack, args)
    except (StackError, LoadError) as exc:
        return skipped(f"{type(exc).__name__}: {str(exc)[:2000]}")


def report(args: argparse.Namespace, systems: dict[str, dict[str, Any]], argv: Sequence[str]) -> dict[str, Any]:
    """The JSON document: `config`, `slo`, `systems`, `ratios` (goodput ratios, RATIOS)."""
    ratios = {name: ratio(systems.get(top, {}).get("goodput_rps"), systems.get(bottom, {}).get("goodput_rps"))
              for name, (top, bottom) in RATIOS.items()}
    config = {k: json_value(v) for k, v in vars(args).items() if k != "specs"}
    config["prompts_per_rate"] = [spec.num_prompts for spec in args.specs]
    config["command"] = shlex.join(["python", "-m", "benchmarks.bench_sweep", *argv])
    return {"config": config, "slo": slo_of(args), "systems": systems, "ratios": ratios}


def slo_text(slo: dict[str, float]) -> str:
    return (f"TTFT <= {slo['ttft_ms']:g} ms and largest gap <= {slo['largest_gap_ms']:g} ms; "
            f"goodput: highest rate with >= {slo['attainment_for_goodput']:.0%} meeting it")


def print_report(out: dict[str, Any]) -> None:
    for name, system in out["systems"].items():
        if system["rates"]:
            print(format_sweep_system(name, system["rates"]) + "\n")
    print(format_sweep_summary(out["systems"], out["ratios"], slo_text(out["slo"])))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    stop_on_sigterm()
    from worker.model.bench_model import create_bench_model  # torch: only once the command line is good

    args.model_dir = str(Path(args.model).resolve()) if args.model else str(create_bench_model())
    before = os.getloadavg()
    try:
        systems = {name: run_system(name, start, args) for name, start in starters(args).items()
                   if name in args.systems}
    except KeyboardInterrupt:
        return interrupted("bench_sweep.py")
    out = report(args, systems, argv)
    out["loadavg"] = {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()]}
    print_report(out)
    write_json(args.json, out)
    if args.json is not None:
        plot = args.json.with_suffix(".png")
        problem = plot_sweep({n: s["rates"] for n, s in systems.items()}, out["slo"], plot)
        print(problem or f"wrote {plot}")
    return 0 if any(s["rates"] for s in systems.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
