"""vLLM 1P1D with our NeuronConnector against the other ways of serving on the same two cores.

Starts and measures, one after the other, on the same model and the same two cores, each loaded
by the same client, vLLM's own `vllm bench serve` (random prompts, fixed seed, --ignore-eos):
  vllm_colocated  two plain `vllm serve` replicas, one per core, our proxy round-robining them
  vllm_nixl       vLLM 1P1D with vLLM's own NixlConnector, our proxy driving its handoff
                  (--kv-protocol nixl); skipped where `import nixl` fails (pip install nixl)
  vllm_neuron     vLLM 1P1D with our NeuronConnector behind our proxy
  neuron_di       our own worker's 1P1D behind our proxy
  vllm_one_core   one plain `vllm serve` on the second core alone, behind our proxy: what one core
                  serves (1P1D decodes on one core; its decode steps compare with this one's ITL p50)
Per system: request throughput, TTFT mean and p99, TPOT mean and p99, ITL p99 and failed
requests (read from the client's saved JSON), and idle CPU: the CPU time of every process of the
stack (each with its children) over a window after the stack is up and before load, in cores.
Ratios put vllm_neuron over vllm_nixl and over vllm_colocated (the same vLLM engine, only the
way its two cores are used differs); a ratio whose systems were not both measured is null.
A system that cannot start or be measured is reported as skipped, with the reason, and the
others still run.

    python -m benchmarks.bench_vllm --quick                 # 128 in / 32 out, 16 prompts
    python -m benchmarks.bench_vllm --json benchmarks/results/vllm_connectors.json   # 512 / 128, 40

Each vLLM server takes about 60-90 s to start on a 2-core machine (four vLLM stacks are started),
so even --quick takes several minutes; its load part is well under a minute per system.
Exit status: 0 every system measured with no failed request (vllm_nixl may be skipped for want
of nixl), 1 a system could not be measured, 2 bad arguments, 3 some requests failed.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.bench_cli import fill_defaults, interrupted, parse_systems, stop_on_sigterm, write_json
from stack.serving import Stack, StackError, StackOptions, start_di
from benchmarks.vllm_bench_client import (CLIENT, ClientError, ClientLoad, client_metrics, run_client,
                                        served_model)
from stack.vllm import (VllmOptions, start_colocated, start_colocated_pair, start_neuron_1p1d,
                                 start_nixl_1p1d)

SYSTEMS = ("vllm_colocated", "vllm_nixl", "vllm_neuron", "neuron_di", "vllm_one_core")
# Unset flags take these values; --quick picks the second set.
DEFAULTS = {"input_len": (512, 128), "output_len": (128, 32), "num_prompts": (40, 16)}
# Ratio name -> (numerator system, denominator system, metric).
RATIOS = {"neuron_over_nixl_rps": ("vllm_neuron", "vllm_nixl", "request_throughput"),
          "neuron_over_nixl_ttft_mean": ("vllm_neuron", "vllm_nixl", "ttft_mean_ms"),
          "neuron_over_colocated_rps": ("vllm_neuron", "vllm_colocated", "request_throughput"),
          "neuron_over_colocated_itl_p99": ("vllm_neuron", "vllm_colocated", "itl_p99_ms"),
          "neuron_over_colocated_ttft_mean": ("vllm_neuron", "vllm_colocated", "ttft_mean_ms")}
IDLE_CPU = {"neuron_idle_cpu_cores": "vllm_neuron", "nixl_idle_cpu_cores": "vllm_nixl"}
NO_NIXL = "nixl is not installed here (`import nixl` fails; pip install nixl)"
SETTLE_S = 2.0  # after the stack is healthy, before the idle window: startup's tail is not idling


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_vllm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory, or `builtin` (default: the ~24M benchmark model)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--cores", default="0,1", help="the two CPU cores, one per server (default 0,1)")
    p.add_argument("--input-len", type=int, help="prompt tokens (default 512; --quick 128)")
    p.add_argument("--output-len", type=int, help="output tokens (default 128; --quick 32)")
    p.add_argument("--num-prompts", type=int, help="requests (default 40; --quick 16)")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--num-warmups", type=int, default=8, help="unmeasured requests first (client's --num-warmups)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048, help="context length of every server")
    p.add_argument("--idle-window", type=float, default=5.0, help="seconds of idle CPU measurement")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a stack to come up")
    p.add_argument("--client-timeout", type=float, default=900.0, help="seconds for one client run")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true",
                   help="short prompts, few requests: each system's load well under a minute "
                        "(starting the vLLM servers still takes ~60-90 s per stack)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    fill_defaults(args, DEFAULTS)
    args.systems = parse_systems(parser, args.systems, SYSTEMS)
    try:
        args.cores = tuple(int(c) for c in args.cores.split(","))
    except ValueError:
        parser.error(f"--cores: expected two integers, got {args.cores!r}")
    usable = os.sched_getaffinity(0)
    if len(args.cores) != 2 or args.cores[0] == args.cores[1] or not set(args.cores) <= usable:
        parser.error(f"--cores: need two different usable cores (usable: {sorted(usable)}), got {args.cores}")
    if min(args.input_len, args.output_len, args.num_prompts, args.max_concurrency) < 1 or args.num_warmups < 0:
        parser.error("lengths, --num-prompts and --max-concurrency must be at least 1, --num-warmups at least 0")
    if args.input_len + args.output_len > args.max_model_len:
        parser.error(f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds "
                     f"--max-model-len {args.max_model_len}")
    args.model = _model_dir(args.model)
    return args


def _model_dir(model: str | None) -> str:
    from worker.model.bench_model import create_bench_model
    from worker.model.loader import builtin_model_path

    if model == "builtin":
        return str(builtin_model_path())
    return str(Path(model).resolve()) if model else str(create_bench_model())


def starters(args: argparse.Namespace) -> dict[str, Callable[[], Stack]]:
    vllm = VllmOptions(model=args.model, cores=args.cores, max_model_len=args.max_model_len,
                       startup_timeout_s=args.startup_timeout)
    ours = StackOptions(cores=args.cores, model=args.model, startup_timeout_s=args.startup_timeout)
    return {"vllm_colocated": lambda: start_colocated_pair(vllm), "vllm_nixl": lambda: start_nixl_1p1d(vllm),
            "vllm_neuron": lambda: start_neuron_1p1d(vllm), "neuron_di": lambda: start_di(ours),
            "vllm_one_core": lambda: start_colocated(replace(vllm, cores=(args.cores[1],) * 2), proxied=True)}


def nixl_problem() -> str | None:
    """Why vllm_nixl cannot run here, or None. Imported in a child: nixl loads native libraries."""
    try:
        done = subprocess.run([sys.executable, "-c", "import nixl"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "`import nixl` did not finish within 120 s"
    return None if done.returncode == 0 else NO_NIXL


# --- measuring one system -------------------------------------------------------------------

def tree_cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants, living and reaped."""
    import psutil  # installed with vLLM

    procs: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs.update((p.pid, p) for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            continue
    total = 0.0
    for proc in procs.values():
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue  # exited while we looked; its parent's children_* have it once reaped
        total += t.user + t.system + t.children_user + t.children_system
    return total


def idle_cpu_cores(stack: Stack, window_s: float) -> dict[str, float]:
    """Cores each process of the stack (with its children) uses while the stack serves nothing."""
    pids = {p.name: p.proc.pid for p in stack.processes}
    time.sleep(SETTLE_S)
    before, start = {name: tree_cpu_seconds([pid]) for name, pid in pids.items()}, time.monotonic()
    time.sleep(window_s)
    after, wall = {name: tree_cpu_seconds([pid]) for name, pid in pids.items()}, time.monotonic() - start
    return {name: (after[name] - before[name]) / wall for name in pids}


def client_load(args: argparse.Namespace) -> ClientLoad:
    return ClientLoad(tokenizer=args.model, input_len=args.input_len, output_len=args.output_len,
                      num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
                      num_warmups=args.num_warmups, seed=args.seed, timeout_s=args.client_timeout)


def measure(name: str, start: Callable[[], Stack], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    print(f"starting {name} ...", file=sys.stderr, flush=True)
    started_at = time.monotonic()
    with start() as stack:
        startup_s = time.monotonic() - started_at
        idle = idle_cpu_cores(stack, args.idle_window)
        model = served_model(stack.url)
        print(f"{name}: up in {startup_s:.0f} s, idle {sum(idle.values()):.3f} cores; loading it ...",
              file=sys.stderr, flush=True)
        metrics = client_metrics(run_client(client_load(args), stack.url, model, workdir / f"{name}.json"))
    return {**metrics, "idle_cpu_cores": sum(idle.values()), "idle_cpu_cores_by_process": idle,
            "startup_s": startup_s, "served_model": model}


def skipped(exc: BaseException) -> dict[str, str]:
    """The table's one-line reason, and the log tail behind it."""
    text = str(exc).strip()
    return {"skipped": short_reason(text), "detail": text[-4000:]}


def short_reason(text: str) -> str:
    """The first line, plus the last line of a log tail that names an error."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    errors = [line for line in lines[1:] if "Error" in line or "Exception" in line]
    return f"{lines[0]} {errors[-1]}" if errors else lines[0]


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    systems: dict[str, dict[str, Any]] = {}
    start = starters(args)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as workdir:
        for name in args.systems:
            problem = nixl_problem() if name == "vllm_nixl" else None
            if problem:
                systems[name] = {"skipped": problem}
                continue
            try:
                systems[name] = measure(name, start[name], args, Path(workdir))
            except (StackError, ClientError) as exc:
                systems[name] = skipped(exc)
            print(f"{name}: {systems[name].get('skipped', 'measured')}", file=sys.stderr, flush=True)
    return systems


# --- the report -----------------------------------------------------------------------------

def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    out = {name: ratio(systems.get(a, {}).get(metric), systems.get(b, {}).get(metric))
           for name, (a, b, metric) in RATIOS.items()}
    out.update({name: systems.get(system, {}).get("idle_cpu_cores") for name, system in IDLE_CPU.items()})
    return out


COLUMNS = [("req/s", "request_throughput", "{:.3f}"), ("TTFT mean", "ttft_mean_ms", "{:.1f}"),
           ("TTFT p99", "ttft_p99_ms", "{:.1f}"), ("TPOT mean", "tpot_mean_ms", "{:.2f}"),
           ("TPOT p99", "tpot_p99_ms", "{:.2f}"), ("ITL p50", "itl_p50_ms", "{:.2f}"),
           ("ITL p99", "itl_p99_ms", "{:.2f}"), ("failed", "failed", "{:d}"),
           ("idle cores", "idle_cpu_cores", "{:.3f}")]


def format_table(systems: dict[str, dict[str, Any]], ratio_values: dict[str, float | None]) -> str:
    head = f"{'system':16}" + "".join(f"{title:>11}" for title, _, _ in COLUMNS)
    rows = [head, "-" * len(head)]
    for name, metrics in systems.items():
        if "skipped" in metrics:
            rows.append(f"{name:16} skipped: {metrics['skipped']}")
        else:
            rows.append(f"{name:16}" + "".join(f"{fmt.format(metrics[key]):>11}" for _, key, fmt in COLUMNS))
    rows.append("times in ms; idle cores = CPU seconds of the stack's processes per second before load")
    rows += [f"{name:32} {'null' if value is None else f'{value:.3f}'}" for name, value in ratio_values.items()]
    return "\n".join(rows)


def report(args: argparse.Namespace, systems: dict[str, dict[str, Any]], argv: Sequence[str]) -> dict[str, Any]:
    settings = {key: getattr(args, key) for key in ("input_len", "output_len", "num_prompts", "max_concurrency",
                                                    "num_warmups", "seed", "max_model_len", "idle_window",
                                                    "quick", "systems")}
    settings.update(cores=list(args.cores), client=CLIENT)
    return {"command": shlex.join(["python", "-m", "benchmarks.bench_vllm", *argv]), "model": args.model,
            "settings": settings, "systems": systems, "ratios": ratios(systems)}


def exit_status(systems: dict[str, dict[str, Any]]) -> int:
    if any(m.get("skipped") not in (None, NO_NIXL) for m in systems.values()):
        return 1
    return 3 if any(m.get("failed") for m in systems.values()) else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    stop_on_sigterm()
    before = os.getloadavg()
    try:
        systems = run(args)
    except KeyboardInterrupt:
        return interrupted("bench_vllm.py")
    out = report(args, systems, argv)
    out["loadavg"] = {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()]}
    print(format_table(systems, out["ratios"]))
    for name, metrics in systems.items():
        if metrics.get("first_error"):
            print(f"{name}: {metrics['failed']} failed, first: {metrics['first_error']}")
    write_json(args.json, out)
    return exit_status(systems)


if __name__ == "__main__":
    sys.exit(main())
