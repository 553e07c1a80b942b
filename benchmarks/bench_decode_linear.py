"""The AMX decode linear against torch's call into oneDNN, inside the engine: two engines on the same model in
one process, one whose linears keep the kernel's packed weights and one whose linears do not, run in turns.

    python -m benchmarks.bench_decode_linear [--quick] [--json PATH] [--repeats N]

Workloads (bf16, one thread, 8 sequences at a time, 512 tokens a step, prefix caching off):
  builtin_128_64    the built-in model, 8 prompts of 128 tokens, 64 new each: median decode step
  bench24m_512_128  the ~24M benchmark model, 8 of 512, 128 new: median decode step
  bench24m_2000_64  the benchmark model, 16 of 2000 (8 with --quick), 64 new: seconds for them all, prompt
                    chunks mixed with decodes as a server runs them
Each repeat runs both engines on the same new prompts, the order alternating. The table gives the medians over
the repeats, without / with, and whether both engines picked the same tokens (they must: the kernel's sums are
oneDNN's, bit for bit). Needs a CPU with AMX: exit status 1 elsewhere.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from worker import EngineConfig, LLMEngine, SamplingParams, create_bench_model
from worker.model.layers import decode_linear
from worker.model.layers.linear import Linear

BUILTIN = Path(__file__).resolve().parent.parent / "worker" / "model" / "assets" / "builtin"


@dataclass(frozen=True)
class Workload:
    model: str          # "builtin" or "bench24m"
    prompts: int
    prompt_len: int
    new_tokens: int
    metric: str         # "decode step ms" (the median step once every sequence decodes) or "seconds" (all of it)


WORKLOADS = {"builtin_128_64": Workload("builtin", 8, 128, 64, "decode step ms"),
             "bench24m_512_128": Workload("bench24m", 8, 512, 128, "decode step ms"),
             "bench24m_2000_64": Workload("bench24m", 16, 2000, 64, "seconds")}


def engine(path: Path, kernel: bool) -> LLMEngine:
    made = LLMEngine(EngineConfig(model=str(path), max_num_seqs=8, kv_cache_bytes=512 * 2**20, dtype="bfloat16",
                                  enable_prefix_caching=False, max_num_batched_tokens=512))
    linears = [m for m in made.runner.model.modules() if isinstance(m, Linear)]
    if not kernel:
        for linear in linears:
            linear.decode_weight = None
    assert any(m.decode_weight is not None for m in linears) == kernel
    return made


def run(made: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """Runs the prompts to the end: (median decode step in ms, seconds in all) and each prompt's tokens."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        made.add_request(f"{tag}-{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    decode_steps: list[float] = []
    start = time.perf_counter()
    while made.has_unfinished_requests():
        decoding = len(tokens) == len(prompts)   # every prompt has its first token: this step only decodes
        step_start = time.perf_counter()
        outputs = made.step()
        if decoding:
            decode_steps.append(time.perf_counter() - step_start)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - start
    step_ms = statistics.median(decode_steps) * 1000 if decode_steps else float("nan")
    return (step_ms, elapsed), [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def measure(name: str, workload: Workload, repeats: int, quick: bool) -> dict[str, object]:
    path = BUILTIN if workload.model == "builtin" else create_bench_model(None)
    engines = {"without": engine(path, kernel=False), "with": engine(path, kernel=True)}
    count = 8 if quick and workload.metric == "seconds" else workload.prompts
    rng = random.Random(0)
    figures: dict[str, list[float]] = {side: [] for side in engines}
    same = True
    for repeat in range(repeats):
        prompts = [[rng.randrange(32, 127) for _ in range(workload.prompt_len)] for _ in range(count)]
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        picked = {}
        for side in order:
            (step_ms, seconds), picked[side] = run(engines[side], prompts, workload.new_tokens, f"{side}{repeat}")
            figures[side].append(step_ms if workload.metric == "decode step ms" else seconds)
        same = same and picked["with"] == picked["without"]
        print(f"  {name} repeat {repeat + 1}/{repeats}: " + ", ".join(f"{s} {figures[s][-1]:.3f}" for s in engines),
              file=sys.stderr)
    medians = {side: statistics.median(values) for side, values in figures.items()}
    return {"metric": workload.metric, "prompts": count, "runs": figures, "median": medians,
            "without_over_with": medians["without"] / medians["with"], "same_tokens": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, 8 prompts at 2000 tokens (< 1 min)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each engine per workload (default 6)")
    args = parser.parse_args()
    if not decode_linear.SUPPORTED:
        sys.exit("no AMX here (or the decode-linear kernel was not built): nothing to compare")
    torch.set_num_threads(1)
    repeats = args.repeats or (2 if args.quick else 6)
    load_before = os.getloadavg()
    results = {name: measure(name, workload, repeats, args.quick) for name, workload in WORKLOADS.items()}
    print(f"{'workload':18} {'metric':15} {'without':>9} {'with':>9} {'ratio':>6}  same tokens")
    for name, result in results.items():
        median = result["median"]
        print(f"{name:18} {result['metric']:15} {median['without']:9.3f} {median['with']:9.3f} "
              f"{result['without_over_with']:6.2f}  {result['same_tokens']}")
    if args.json:
        report = {"command": "python -m benchmarks.bench_decode_linear " + " ".join(sys.argv[1:]),
                  "repeats": repeats, "quick": args.quick, "load_before": load_before,
                  "load_after": os.getloadavg(), "results": results}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not all(result["same_tokens"] for result in results.values()):
        sys.exit("the engines with and without the kernel picked different tokens")


if __name__ == "__main__":
    main()
