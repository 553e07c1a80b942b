"""Where the time of one long prefill goes, per dtype: linear layers, attention, the rest.

    python -m benchmarks.profile_prefill [--prompt-len 2000] [--dtype float32 bfloat16] [--attention native|torch] [--json PATH]

One prompt of --prompt-len tokens on the ~24M benchmark model, one torch thread, run as the worker
runs it (chunked prefill, --max-num-batched-tokens a step; --no-chunks: the whole prompt in one step).
Wall time is the best of --repeats; the split comes from torch's profiler over one more run (ops'
self time, so nothing is counted twice). The linear layers' GFLOP/s (their FLOPs over their time) is
set against a ceiling: what the engine's Linear reaches at the MLP's shape on this thread. Prompt
attention runs where the engine runs it: the native kernel on a CPU with AVX-512 (BF16 for bf16; on AMX
tiles for bf16 where the CPU has them), else torch's flash kernel; --attention picks either.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_engine import make_prompts
from worker import EngineConfig, LLMEngine, SamplingParams, create_bench_model
from worker.model.layers import prefill_native
from worker.model.layers.linear import Linear
from worker.model.model_config import ModelConfig

# Profiler op name -> the part of the model it belongs to; anything else is "other".
PARTS = {"mkldnn::_linear_pointwise": "linear", "aten::mm": "linear", "aten::addmm": "linear",
         "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
         "aten::_scaled_dot_product_attention_math": "attention", prefill_native.PROFILER_NAME: "attention"}


def linear_flops_per_token(config: ModelConfig) -> float:
    """FLOPs of the decoder's linear layers for one prompt token (the LM head runs on the last token only)."""
    attention = config.hidden_size * config.head_dim * 2 * (config.num_attention_heads + config.num_key_value_heads)
    return 2.0 * config.num_hidden_layers * (attention + 3 * config.hidden_size * config.intermediate_size)


def linear_ceiling(config: ModelConfig, dtype: str, rows: int, seconds: float = 1.0) -> float:
    """GFLOP/s of the engine's Linear (oneDNN-packed where it packs) as the MLP's up projection, for `rows`
    tokens, repeated for `seconds`: what the model's linear layers could reach on this thread."""
    kind = getattr(torch, dtype)
    layer = Linear(config.hidden_size, config.intermediate_size, bias=False).to(kind).eval()
    layer.pack()
    x = torch.randn(rows, config.hidden_size, dtype=kind)
    with torch.no_grad():
        layer(x)   # warm-up
        runs, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            layer(x)
            runs += 1
    return 2.0 * rows * config.hidden_size * config.intermediate_size * runs / elapsed / 1e9


def profile_prefill(path: Path, dtype: str, prompt_len: int, budget: int | None, repeats: int) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, enable_prefix_caching=False,
                                    enable_chunked_prefill=budget is not None,
                                    max_num_batched_tokens=budget or prompt_len, kv_cache_bytes=256 * 2**20))
    prompt, params = make_prompts(1, prompt_len, seed=1), SamplingParams(max_tokens=1, temperature=0)
    engine.generate(prompt, params)   # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(prompt, params)
        best = min(best, time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompt, params)
    parts = {"linear": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        parts[PARTS.get(event.key, "other")] += event.self_cpu_time_total / 1e6
    profiled = sum(parts.values())
    config = ModelConfig.from_dir(path)
    return {"wall_s": best, "tok_s": prompt_len / best, **{f"{k}_s": v for k, v in parts.items()},
            **{f"{k}_share": v / profiled for k, v in parts.items()},
            "linear_gflops": linear_flops_per_token(config) * prompt_len / parts["linear"] / 1e9,
            "linear_ceiling_gflops": linear_ceiling(config, dtype, min(budget or prompt_len, prompt_len))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--no-chunks", action="store_true", help="the whole prompt in one step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention", choices=["native", "torch"],
                        help="prompt attention in the native kernel or in torch (default: as the engine picks)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget = None if args.no_chunks else args.max_num_batched_tokens
    if args.attention == "native" and not {getattr(torch, name) for name in args.dtype} <= prefill_native.SUPPORTED:
        parser.error(f"--attention native: the kernel is not built or this CPU cannot run it in {args.dtype}")
    if args.attention:
        prefill_native.NATIVE = prefill_native.SUPPORTED if args.attention == "native" else frozenset()
    path = create_bench_model()
    report: dict[str, object] = {"prompt_len": args.prompt_len, "chunk_tokens": budget,
                                 "native_attention": [name for name in args.dtype
                                                      if getattr(torch, name) in prefill_native.NATIVE],
                                 "load_before": os.getloadavg()}
    print(f"{'dtype':<10}{'wall s':>8}{'tok/s':>8}{'linear s':>10}{'attn s':>8}{'other s':>9}"
          f"{'linear GFLOP/s':>16}{'ceiling':>9}   "
          f"(prompt {args.prompt_len}, {'one step' if budget is None else f'{budget}-token chunks'})")
    for dtype in args.dtype:
        row = profile_prefill(path, dtype, args.prompt_len, budget, args.repeats)
        report[dtype] = row
        print(f"{dtype:<10}{row['wall_s']:>8.3f}{row['tok_s']:>8.0f}{row['linear_s']:>10.3f}"
              f"{row['attention_s']:>8.3f}{row['other_s']:>9.3f}{row['linear_gflops']:>16.0f}"
              f"{row['linear_ceiling_gflops']:>9.0f}")
    report["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
