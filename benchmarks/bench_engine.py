"""Prefill and decode throughput of the engine vs transformers' generate(), same weights, same run, per dtype.

    python -m benchmarks.bench_engine [--quick] [--json PATH] [--threads N] [--dtype float32 bfloat16]

Both sides run greedy on the ~24M-parameter benchmark model (random weights, built once in
the cache dir), at each --dtype in turn. Prefill tokens/s = batch * prompt_len / time of a
1-token generation; decode tokens/s = batch * (new_tokens - 1) / (time of a new_tokens
generation - that prefill time); long prefill: one 2000-token prompt (512 with --quick), a
1-token generation. Each point is the best of --repeats runs, ours and transformers at every
dtype interleaved. With two dtypes, the table ends with what our engine gains from the second over
the first (bf16 over fp32). Our engine runs as the worker does: chunked prefill, 512 tokens a step.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable, Protocol

import torch

from worker import EngineConfig, LLMEngine, SamplingParams, create_bench_model


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[256] + [rng.randrange(32, 127) for _ in range(length - 1)] for _ in range(batch)]


class Runner(Protocol):
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]: ...


class Ours:
    def __init__(self, path: Path, dtype: str) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(path), max_num_seqs=8, kv_cache_bytes=128 * 2**20,
                                             dtype=dtype, enable_prefix_caching=False))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        return self.engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))


class Transformers:
    def __init__(self, path: Path, dtype: str) -> None:
        import transformers

        self.model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts)  # equal lengths: no padding needed
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()


def measure(runners: dict[str, Runner], batch: int, prompt_len: int, new_tokens: int,
            repeats: int) -> tuple[dict[str, dict[str, float]], dict[str, bool]]:
    """Tokens/s per runner ("ours DTYPE", "transformers DTYPE") and phase, and per dtype whether both
    runners produced the same greedy tokens."""
    prompts = make_prompts(batch, prompt_len, seed=batch)
    best = {name: {"prefill": float("inf"), "full": float("inf")} for name in runners}
    outputs: dict[str, list[list[int]]] = {}
    for runner in runners.values():
        runner.generate(prompts, 2)  # warm-up
    for _ in range(repeats):  # interleaved, so load from elsewhere hits every runner alike
        for name, runner in runners.items():
            best[name]["prefill"] = min(best[name]["prefill"], seconds(lambda: runner.generate(prompts, 1)))
            if new_tokens > 1:
                full = seconds(lambda: outputs.__setitem__(name, runner.generate(prompts, new_tokens)))
                best[name]["full"] = min(best[name]["full"], full)
    rates = {name: {"prefill": batch * prompt_len / t["prefill"],
                    "decode": batch * (new_tokens - 1) / max(t["full"] - t["prefill"], 1e-9)}
             for name, t in best.items()}
    dtypes = {name.split()[-1] for name in runners}
    same = {d: len({json.dumps(o) for n, o in outputs.items() if n.endswith(d)}) == 1 for d in dtypes if outputs}
    return rates, same


def bench(path: Path, dtypes: list[str], prompt_len: int, new_tokens: int, long_len: int,
          repeats: int) -> dict[str, dict[str, object]]:
    """Every point, ours against transformers at each dtype, all runners interleaved in each repeat (so
    load from elsewhere hits every dtype alike, and the dtype ratios hold up on a busy machine); prints rows."""
    runners: dict[str, Runner] = {}
    for dtype in dtypes:
        runners |= {f"ours {dtype}": Ours(path, dtype), f"transformers {dtype}": Transformers(path, dtype)}
    report: dict[str, dict[str, object]] = {dtype: {} for dtype in dtypes}
    points = [(batch, prompt_len, new_tokens, phase, f"{phase}_b{batch}")
              for batch in (1, 8) for phase in ("prefill", "decode")]
    points.append((1, long_len, 1, "prefill", "long_prefill"))
    measured: dict[tuple[int, int], tuple[dict[str, dict[str, float]], bool]] = {}
    for batch, length, new, phase, key in points:
        if (batch, length) not in measured:
            measured[(batch, length)] = measure(runners, batch, length, new, repeats)
        rates, _ = measured[(batch, length)]
        for dtype in dtypes:
            ours, ref = rates[f"ours {dtype}"][phase], rates[f"transformers {dtype}"][phase]
            report[dtype] |= {f"{key}_tok_s": ours, f"{key}_transformers_tok_s": ref,
                              f"{key}_ratio_vs_transformers": ours / ref}
            print(f"{dtype:<10}{key:<14}{ours:>12.1f}{ref:>14.1f}{ours / ref:>8.2f}", flush=True)
    for batch in (1, 8):   # greedy tokens: ours against transformers at each dtype
        outputs = measured[(batch, prompt_len)][1]
        for dtype in dtypes:
            report[dtype][f"b{batch}_same_greedy_tokens"] = outputs.get(dtype)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short prompts and generations (< 2 min)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Quick runs are short enough that one sample swings by +-10%: take the best of 3 there too.
    prompt_len, new_tokens, long_len, repeats = (64, 24, 512, 3) if args.quick else (256, 128, 2000, 3)
    repeats = args.repeats or repeats
    path = create_bench_model(args.cache_dir)
    report: dict[str, object] = {"command": " ".join(["python -m benchmarks.bench_engine", *sys.argv[1:]]),
                                 "prompt_len": prompt_len, "new_tokens": new_tokens, "long_prompt_len": long_len,
                                 "threads": args.threads, "dtypes": args.dtype, "load_before": os.getloadavg()}
    print(f"{'dtype':<10}{'':<14}{'ours tok/s':>12}{'transformers':>14}{'ratio':>8}   "
          f"(prompt {prompt_len}, new {new_tokens}; long prompt {long_len})")
    per_dtype = bench(path, args.dtype, prompt_len, new_tokens, long_len, repeats)
    report |= {f"{dtype}_{key}": value for dtype, rows in per_dtype.items() for key, value in rows.items()}
    if len(args.dtype) == 2:
        first, second = args.dtype
        for key in ("prefill_b1", "prefill_b8", "long_prefill", "decode_b1", "decode_b8"):
            gain = per_dtype[second][f"{key}_tok_s"] / per_dtype[first][f"{key}_tok_s"]  # type: ignore[operator]
            report[f"ours_{key}_{second}_over_{first}"] = gain
            print(f"ours {second} / {first} {key:<14}{gain:>8.2f}")
    report["load_after"] = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {report['load_before']}, after {report['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
