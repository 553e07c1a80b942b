"""Offline disaggregated inference in one command, checked against a non-disaggregated run.

    python examples/neuron_di.py [--model PATH] [--kv-transport auto|shm|tcp] [--max-tokens 32]
    python examples/neuron_di.py --temperature 0.8 --seed 1     # seeded sampling instead of greedy

Starts a prefill worker, a decode worker and the proxy on free ports on 127.0.0.1, generates
greedily (or with seeded sampling) for a built-in list of prompts through the proxy (the prompt's KV cache moves from
the prefill worker to the decode worker), then runs the same prompts on an in-process engine
in role `both` and compares the outputs token count and text. Prints the outputs, "outputs
match" (exit 0) or the first mismatch (exit 1), and KV-transfer statistics. Every process
started is stopped on the way out, also on Ctrl-C or an error. Exit status 2: bad arguments;
3: the stack could not be started or a request failed.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING, Sequence

import httpx
from tqdm import tqdm

from benchmarks.di_stats import Completion, diverging_at, first_mismatch, format_summary, summarize
from stack.serving import StackError, StackOptions, start_di
from worker.model.loader import BUILTIN_MODEL_NOTE

if TYPE_CHECKING:
    from transfer.layout import KVLayout

# The built-in model is a tiny byte-level model trained on Python's stdlib: it continues code.
PROMPTS = (
    "import os\n",
    "def add(a, b):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "for i in range(10):\n    if i % 2 == 0:\n        ",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        ",
    "#!/usr/bin/env python3\n\"\"\"Command line tool.\"\"\"\nimport argparse\n\n\ndef main():\n    parser = ",
    "def fib(n):\n    if n < 2:\n        return n\n    return ",
    ("from __future__ import annotations\n\nimport sys\nfrom dataclasses import dataclass\n\n\n"
     "@dataclass\nclass Point:\n    x: float\n    y: float\n\n    def norm(self) -> float:\n"
     "        return (self.x ** 2 + self.y ** 2) ** 0.5\n\n\ndef parse(line: str) -> Point:\n"
     "    x, y = line.split(',')\n    return Point(float(x), float(y))\n\n\ndef main() -> int:\n    "),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuron_di.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--kv-transport", default="auto", choices=("auto", "shm", "tcp"),
                   help="how the KV cache moves between the workers (default auto)")
    p.add_argument("--max-tokens", type=_positive, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--num-prompts", type=_positive, default=len(PROMPTS),
                   help=f"use the first N built-in prompts (default all {len(PROMPTS)})")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sampling")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of every request (default 0)")
    p.add_argument("--concurrency", type=_positive, default=4, help="requests in flight (default 4)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for each process to be ready")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one request")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def encode_prompts(model: str | None, texts: Sequence[str]) -> list[list[int]]:
    """The prompts as token ids, so both runs see exactly the same input."""
    from worker.model.loader import builtin_model_path, load_config  # imports torch
    from worker.model.tokenizer import load_tokenizer

    path = model or builtin_model_path()
    tokenizer = load_tokenizer(path, load_config(path))
    return [tokenizer.encode(text) for text in texts]


def sampling(args: argparse.Namespace) -> dict[str, float | int]:
    """The sampling fields both runs use, as in a request body."""
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}


def reference_run(model: str | None, prompts: Sequence[list[int]], args: argparse.Namespace
                  ) -> tuple[list[Completion], KVLayout]:
    """Outputs of an in-process engine in role `both`, text built the way the server builds it."""
    from worker.config import EngineConfig  # imports torch: only once the command line is known to be good
    from worker.engine.llm_engine import LLMEngine
    from worker.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model))
    params = SamplingParams(**sampling(args))
    ids = [f"reference-{i}" for i in range(len(prompts))]
    texts: dict[str, list[str]] = {rid: [] for rid in ids}
    counts = dict.fromkeys(ids, 0)
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.text_delta)
            counts[out.request_id] = out.num_output_tokens
    return [Completion(counts[rid], "".join(texts[rid])) for rid in ids], engine.kv_layout


def di_run(url: str, model_name: str, prompts: Sequence[list[int]], args: argparse.Namespace
           ) -> tuple[list[Completion], list[float]]:
    """Outputs through the proxy, `concurrency` at a time, and each request's latency."""
    results: list[Completion | None] = [None] * len(prompts)
    latencies = [0.0] * len(prompts)

    def one(index: int) -> None:
        start = time.perf_counter()
        body = {"model": model_name, "prompt": prompts[index], **sampling(args)}
        reply = client.post("/v1/completions", json=body)
        if reply.status_code != 200:
            raise StackError(f"prompt {index}: HTTP {reply.status_code}: {reply.text[:500]}")
        data = reply.json()
        results[index] = Completion(data["usage"]["completion_tokens"], data["choices"][0]["text"])
        latencies[index] = time.perf_counter() - start

    with httpx.Client(base_url=url, timeout=args.request_timeout) as client:
        pool = ThreadPoolExecutor(args.concurrency)
        try:
            futures = [pool.submit(one, i) for i in range(len(prompts))]
            for future in tqdm(as_completed(futures), total=len(futures), desc="DI generate", unit="req"):
                future.result()
        finally:
            # On Ctrl-C or a failed request, requests still in flight are not awaited: stopping the
            # stack, which comes next, ends them.
            pool.shutdown(wait=False, cancel_futures=True)
    return [r for r in results if r is not None], latencies


def show_outputs(texts: Sequence[str], outputs: Sequence[Completion]) -> None:
    # The continuation is shown quoted: a small model's greedy output is often whitespace.
    for i, (prompt, out) in enumerate(zip(texts, outputs)):
        print(f"\n=== prompt {i}\n{prompt.rstrip()}\n--- {out.num_tokens} tokens generated: {out.text!r}")


def report(texts: Sequence[str], reference: Sequence[Completion], di: Sequence[Completion], builtin: bool) -> int:
    if builtin:
        print(f"\n({BUILTIN_MODEL_NOTE}; what matters here is that DI gives exactly the same)")
    show_outputs(texts, di)
    mismatch = first_mismatch(reference, di)
    if mismatch is None:
        print(f"\noutputs match: {len(di)} prompts, the same text and token count as the non-disaggregated run")
        return 0
    at = diverging_at(mismatch.expected.text, mismatch.got.text)
    print(f"\nOUTPUTS DIFFER at prompt {mismatch.index} (character {at}):\n"
          f"  reference ({mismatch.expected.num_tokens} tokens): {mismatch.expected.text!r}\n"
          f"  DI        ({mismatch.got.num_tokens} tokens): {mismatch.got.text!r}")
    return 1


def run(args: argparse.Namespace) -> int:
    texts = PROMPTS[:args.num_prompts]
    options = StackOptions(model=args.model, kv_transport=args.kv_transport, startup_timeout_s=args.startup_timeout)
    print("starting a prefill worker, a decode worker and the proxy ...", flush=True)
    with start_di(options) as stack:
        model_name = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"proxy {stack.url} -> prefill {stack.worker_urls['prefill worker']}, "
              f"decode {stack.worker_urls['decode worker']} ({model_name}, kv transport {args.kv_transport})")
        prompts = encode_prompts(args.model, texts)
        di, latencies = di_run(stack.url, model_name, prompts, args)
        prefill_metrics = httpx.get(f"{stack.worker_urls['prefill worker']}/metrics", timeout=10).text
    print("running the same prompts without disaggregation ...", flush=True)
    reference, layout = reference_run(args.model, prompts, args)
    status = report(texts, reference, di, args.model is None)
    summary = summarize((len(p) for p in prompts), layout.block_size, layout.block_bytes, prefill_metrics)
    latency = f"{1000 * sum(latencies) / len(latencies):.0f} ms mean end to end ({args.concurrency} in flight)"
    table = format_summary(summary, layout.block_bytes, [("time per request", latency)])
    print(f"\nKV transfer (prefill -> decode, {args.kv_transport}):\n{table}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; every process was stopped", file=sys.stderr)
        return 130
    except (StackError, httpx.HTTPError) as exc:
        print(f"neuron_di failed: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
