"""Our engine against vLLM's CPU build: the same model, the same single core, the same client.

Per workload, one after the other, each server alone on the same core:
  ours  `python -m worker --role both --threads 1` (plus any --ours-extra flags)
  vllm  `vllm serve`, its OpenMP threads bound to that core (VLLM_CPU_OMP_THREADS_BIND)
both with the workload's max model len and KV for --max-concurrency requests of that length,
each loaded by vLLM's own `vllm bench serve --backend openai --dataset-name random --ignore-eos`.
Workloads (model, input / output tokens):
  builtin_128_64     the built-in model, 128 / 64
  bench24m_512_128   the ~24M benchmark model, 512 / 128
  bench24m_2000_64   the ~24M benchmark model, 2000 / 64
Next to ITL p99 stand stalls per request (gaps longer than 3x the run's median ITL: steps that also
prefilled) and the largest gap, since p99 swings on how many gaps hold a prompt chunk.
Ratios are ours over vllm: throughput (req/s), TTFT mean, ITL p99; `worst` is the worst of each
over the workloads, held against the goals throughput >= 1.2, TTFT mean <= 0.8, ITL p99 <= 1.0.

    python -m benchmarks.bench_vs_vllm --quick --workloads builtin_128_64
    python -m benchmarks.bench_vs_vllm --json benchmarks/results/vs_vllm.json
    python -m benchmarks.bench_vs_vllm --dtype bfloat16 --json benchmarks/results/vs_vllm_bf16.json
    python -m benchmarks.bench_vs_vllm --ours-extra "--max-num-seqs 8" --quick
    python -m benchmarks.bench_vs_vllm --systems ours --ours-extra "--max-num-batched-tokens 1024"

--quick loads each system for well under a minute (16 prompts, at most 32 output tokens); starting
a vLLM server takes another 35-90 s per workload on top. Exit status: 0 every system measured with
no failed request, 1 a system could not be measured, 2 bad arguments, 3 some requests failed.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.bench_cli import interrupted, stop_on_sigterm, write_json
from benchmarks.bench_vllm import ratio, skipped
from stack.serving import Stack, StackError, StackOptions, start_both
from benchmarks.vllm_bench_client import (CLIENT, ClientError, ClientLoad, client_metrics, run_client,
                                        served_model)
from stack.vllm import VllmOptions, start_colocated

OUR_BLOCK_SIZE, VLLM_BLOCK_SIZE = 16, 128  # tokens per KV block: our worker's default, vLLM's on CPU
QUICK_OUTPUT_LEN = 32
SYSTEMS = ("ours", "vllm")
# Ratio name -> (metric, target, True when higher is better).
GOALS = {"throughput_vs_vllm": ("request_throughput", 1.2, True),
         "ttft_mean_vs_vllm": ("ttft_mean_ms", 0.8, False),
         "itl_p99_vs_vllm": ("itl_p99_ms", 1.0, False)}


@dataclass(frozen=True, slots=True)
class Workload:
    """A model and the lengths of every request; `max_model_len` is both servers' context."""

    model: str  # "builtin" or "bench24m"
    input_len: int
    output_len: int
    max_model_len: int


SYSTEMS = ("ours", "vllm")
WORKLOADS = {"builtin_128_64": Workload("builtin", 128, 64, 2048),
             "bench24m_512_128": Workload("bench24m", 512, 128, 2048),
             "bench24m_2000_64": Workload("bench24m", 2000, 64, 2112)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_vs_vllm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--core", type=int, default=0, help="the CPU core both servers run on, one after the other")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated subset of ours,vllm (ours alone: to compare our own settings, e.g. "
                        "budgets, without starting vLLM; no ratios then)")
    p.add_argument("--num-prompts", type=int, help="measured requests per system (default 64; --quick 16)")
    p.add_argument("--num-warmups", type=int, help="unmeasured requests first (default 8; --quick 2)")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="what both servers compute in (ours: --dtype; vLLM: --dtype; default float32)")
    p.add_argument("--ours-extra", action="append", default=[], metavar="FLAGS",
                   help='more flags for our worker, e.g. "--max-num-seqs 8" (repeatable; a lone flag '
                        'as --ours-extra=--flag)')
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to come up")
    p.add_argument("--client-timeout", type=float, default=900.0, help="seconds for one client run")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true",
                   help=f"16 prompts, 2 warmups, at most {QUICK_OUTPUT_LEN} output tokens: each system's load "
                        "well under a minute (starting vLLM still takes 35-90 s per workload)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 16 if args.quick else 64
    if args.num_warmups is None:
        args.num_warmups = 2 if args.quick else 8
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown or not args.workloads:
        parser.error(f"--workloads: unknown {unknown}, choose from {','.join(WORKLOADS)}")
    args.systems = [x for x in args.systems.split(",") if x]
    if not args.systems or set(args.systems) - set(SYSTEMS):
        parser.error(f"--systems: a comma-separated subset of {','.join(SYSTEMS)}, got {','.join(args.systems)!r}")
    if args.core not in os.sched_getaffinity(0):
        parser.error(f"--core: {args.core} is not usable here (usable: {sorted(os.sched_getaffinity(0))})")
    if min(args.num_prompts, args.max_concurrency) < 1 or args.num_warmups < 0:
        parser.error("--num-prompts and --max-concurrency must be at least 1, --num-warmups at least 0")
    try:
        args.ours_extra = [flag for text in args.ours_extra for flag in shlex.split(text)]
    except ValueError as exc:
        parser.error(f"--ours-extra: {exc}")
    return args


def lengths(workload: Workload, quick: bool) -> tuple[int, int]:
    """Input and output tokens of each request."""
    return workload.input_len, min(workload.output_len, QUICK_OUTPUT_LEN) if quick else workload.output_len


def kv_blocks(workload: Workload, concurrency: int, block_size: int) -> int:
    """Blocks for `concurrency` requests of the full max model len each."""
    return concurrency * math.ceil(workload.max_model_len / block_size)


def model_dir(model: str) -> str:
    from worker.model.bench_model import create_bench_model
    from worker.model.loader import builtin_model_path

    return str(builtin_model_path() if model == "builtin" else create_bench_model())


def ours_flags(workload: Workload, args: argparse.Namespace) -> list[str]:
    """Our worker's flags beyond the stack's own: the workload's context and KV, the dtype, --ours-extra."""
    return ["--max-model-len", str(workload.max_model_len), "--num-kv-blocks",
            str(kv_blocks(workload, args.max_concurrency, OUR_BLOCK_SIZE)), "--dtype", args.dtype, *args.ours_extra]


def starters(workload: Workload, model: str, args: argparse.Namespace) -> dict[str, Callable[[], Stack]]:
    ours = StackOptions(cores=(args.core, None), model=model, startup_timeout_s=args.startup_timeout)
    vllm = VllmOptions(model=model, cores=(args.core, args.core), max_model_len=workload.max_model_len,
                       num_blocks=kv_blocks(workload, args.max_concurrency, VLLM_BLOCK_SIZE),
                       startup_timeout_s=args.startup_timeout, dtype=args.dtype)
    flags = ours_flags(workload, args)
    every = {"ours": lambda: start_both(ours, flags), "vllm": lambda: start_colocated(vllm)}
    return {system: every[system] for system in args.systems}


def measure(start: Callable[[], Stack], load: ClientLoad, result: Path) -> dict[str, Any]:
    started_at = time.monotonic()
    with start() as stack:
        startup_s = time.monotonic() - started_at
        server = stack.processes[0]
        model = served_model(stack.url)
        metrics = client_metrics(run_client(load, stack.url, model, result))
    return {**metrics, "startup_s": startup_s, "served_model": model,
            "server_command": shlex.join(["python", *server.args]), "server_env": server.env or {}}


def run(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as workdir:
        for name in args.workloads:
            workload = WORKLOADS[name]
            model = model_dir(workload.model)
            input_len, output_len = lengths(workload, args.quick)
            load = ClientLoad(tokenizer=model, input_len=input_len, output_len=output_len,
                              num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
                              num_warmups=args.num_warmups, seed=args.seed, timeout_s=args.client_timeout)
            results[name] = {}
            for system, start in starters(workload, model, args).items():
                print(f"{name}: starting {system} ...", file=sys.stderr, flush=True)
                try:
                    results[name][system] = measure(start, load, Path(workdir) / f"{name}-{system}.json")
                except (StackError, ClientError) as exc:
                    results[name][system] = skipped(exc)
                done = results[name][system]
                print(f"{name}: {system} " + (f"skipped: {done['skipped']}" if "skipped" in done else
                                              f"measured (up in {done['startup_s']:.0f} s)"), file=sys.stderr, flush=True)
    return results


# --- ratios and goals -------------------------------------------------------------------------

def workload_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Ours over vllm for each goal's metric; null unless both were measured."""
    ours, vllm = systems.get("ours", {}), systems.get("vllm", {})
    return {name: ratio(ours.get(metric), vllm.get(metric)) for name, (metric, _, _) in GOALS.items()}


def all_ratios(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Per workload, plus `worst`: the lowest throughput ratio and the highest latency ratios over the
    workloads; null when some workload lacks that ratio (its worst is not known)."""
    out = {name: workload_ratios(systems) for name, systems in results.items()}
    worst: dict[str, float | None] = {}
    for name, (_, _, higher_is_better) in GOALS.items():
        values = [r[name] for r in out.values()]
        known = [v for v in values if v is not None]
        worst[name] = None if len(known) < len(values) or not known else (min if higher_is_better else max)(known)
    out["worst"] = worst
    return out


def goals(worst: dict[str, float | None]) -> dict[str, bool]:
    """Each worst ratio against its target; a ratio not measured does not meet it."""
    met = {}
    for name, (_, target, higher_is_better) in GOALS.items():
        value = worst[name]
        met[name] = value is not None and (value >= target if higher_is_better else value <= target)
    return met


# --- the report -------------------------------------------------------------------------------

COLUMNS = [("req/s", "request_throughput", "{:.3f}"), ("out tok/s", "output_throughput", "{:.1f}"),
           ("TTFT mean", "ttft_mean_ms", "{:.1f}"), ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
           ("TPOT mean", "tpot_mean_ms", "{:.2f}"), ("TPOT p99", "tpot_p99_ms", "{:.2f}"),
           ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p99", "itl_p99_ms", "{:.2f}"),
           ("stalls/req", "stalls_per_request", "{:.2f}"), ("max gap", "largest_gap_ms", "{:.1f}"),
           ("failed", "failed", "{:d}")]


def _number(value: float | None) -> str:
    return "null" if value is None else f"{value:.3f}"


def _cell(fmt: str, value: Any) -> str:
    return "null" if value is None else fmt.format(value)


def format_table(results: dict[str, dict[str, dict[str, Any]]], ratios: dict[str, dict[str, float | None]]) -> str:
    head = f"{'':8}" + "".join(f"{title:>11}" for title, _, _ in COLUMNS)
    rows = []
    for workload, systems in results.items():
        rows += [f"{workload}", head, "-" * len(head)]
        for system, metrics in systems.items():
            if "skipped" in metrics:
                rows.append(f"{system:8}skipped: {metrics['skipped']}")
            else:
                rows.append(f"{system:8}" + "".join(f"{_cell(fmt, metrics.get(key)):>11}" for _, key, fmt in COLUMNS))
        rows.append("ours/vllm: " + ", ".join(f"{name} {_number(v)}" for name, v in ratios[workload].items()))
        rows.append("")
    met = goals(ratios["worst"])
    rows.append("times in ms; worst over the workloads (goal):")
    rows += [f"  {name:20} {_number(ratios['worst'][name])}  ({'>=' if up else '<='} {target:g}: "
             f"{'met' if met[name] else 'not met'})" for name, (_, target, up) in GOALS.items()]
    return "\n".join(rows)


def report(args: argparse.Namespace, results: dict[str, dict[str, dict[str, Any]]],
           argv: Sequence[str]) -> dict[str, Any]:
    options = {key: value for key, value in vars(args).items() if key != "json"}
    config = {**options, "json": str(args.json) if args.json else None, "client": CLIENT,
              "command": shlex.join(["python", "-m", "benchmarks.bench_vs_vllm", *argv]),
              "workload_specs": {name: {**asdict(WORKLOADS[name]), "run_lengths": lengths(WORKLOADS[name], args.quick)}
                                 for name in args.workloads}}
    ratios = all_ratios(results)
    return {"config": config, "results": results, "ratios": ratios, "goals": goals(ratios["worst"])}


def exit_status(results: dict[str, dict[str, dict[str, Any]]]) -> int:
    measured = [m for systems in results.values() for m in systems.values()]
    if any("skipped" in m for m in measured):
        return 1
    return 3 if any(m.get("failed") for m in measured) else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    stop_on_sigterm()
    try:
        results = run(args)
    except KeyboardInterrupt:
        return interrupted("bench_vs_vllm.py")
    out = report(args, results, argv)
    print(format_table(results, out["ratios"]))
    for workload, systems in results.items():
        for system, metrics in systems.items():
            if metrics.get("first_error"):
                print(f"{workload} {system}: {metrics['failed']} failed, first: {metrics['first_error']}")
    write_json(args.json, out)
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
