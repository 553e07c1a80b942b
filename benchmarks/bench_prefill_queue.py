"""The global prefill queue against round-robin: prompts of mixed length over two prefill workers.

    python -m benchmarks.bench_prefill_queue [--quick] [--json PATH] [--png PATH]

Two prefill workers and one decode worker (the simulated engine, `--engine mock`: the benchmark model's
tokenizer and KV layout, real KV transfers, each step sleeping its calibrated cost, so the three share two
cores without starving each other) behind two proxies: one round-robins prefill legs over HTTP (the default),
the other puts them on a real nats-server's JetStream queue, which the workers pull from while they have room
(`--prefill-queue-max-jobs`). The same prompts (64 to 4088 tokens, log-uniform, so a few long ones hold a
worker while short ones arrive) at the same Poisson arrivals go through each; the table shows TTFT and the
ratio `queue_over_round_robin_ttft_p99` (the goal: <= 0.7).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.serving_load import TOKEN_ID_RANGE, LoadSpec, SyntheticRequest, fetch_model, run_load, warm_up
from benchmarks.serving_metrics import SLO, summarize
from benchmarks.serving_report import format_table, plot_distributions
from stack.nats import NatsServer
from stack.serving import Process, StackOptions, free_port, proxy_args, wait_healthy, worker_args
from worker.model.bench_model import create_bench_model

RESULTS = Path(__file__).resolve().parent / "results"
INPUT_LEN, OUTPUT_LEN = (64, 4088), (4, 8)   # the benchmark model's context is 4096 tokens
SYSTEMS = ("round_robin", "queue")


def mixed_prompts(num: int, seed: int) -> list[SyntheticRequest]:
    """`num` prompts of log-uniform length in INPUT_LEN: most short, some near the context's length."""
    rng = random.Random(seed)
    low, high = INPUT_LEN
    out = []
    for _ in range(num):
        n = int(math.exp(rng.uniform(math.log(low), math.log(high))))
        out.append(SyntheticRequest([rng.randint(*TOKEN_ID_RANGE) for _ in range(n)], rng.randint(*OUTPUT_LEN)))
    return out


def start(stack: ExitStack, name: str, args: list[str]) -> Process:
    process = Process(name, args)
    stack.callback(process.stop)
    return process


def start_workers(stack: ExitStack, model: str, nats_url: str, max_jobs: int) -> tuple[list[str], list[Process]]:
    """Two prefill workers pulling from `nats_url` (and serving HTTP legs) and a decode worker, all simulated."""
    options = StackOptions(model=model, worker_extra=("--engine", "mock"))
    backends, processes, ports = [], [], []
    for role in ("prefill", "prefill", "decode"):
        port = free_port()
        args = worker_args(role, port, options, free_port() if role == "prefill" else None)
        if role == "prefill":
            args += ["--prefill-queue", nats_url, "--prefill-queue-max-jobs", str(max_jobs)]
            backends.append(f"--prefill=127.0.0.1:{port}:{args[args.index('--kv-port') + 1]}")
        else:
            backends.append(f"--decode=127.0.0.1:{port}")
        processes.append(start(stack, f"{role}-worker", args))
        ports.append(port)
    for port in ports:
        wait_healthy(f"http://127.0.0.1:{port}/health", processes, 180)
    return backends, processes


def start_proxy(stack: ExitStack, backends: list[str], extra: list[str]) -> str:
    port = free_port()
    process = start(stack, "proxy", [*proxy_args(port, backends), *extra])
    url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{url}/ready", [process], 60)
    return url


async def measure(url: str, spec: LoadSpec, prompts: list[SyntheticRequest]) -> tuple[dict[str, Any], list]:
    model = await fetch_model(url)
    await warm_up(url, model, 4)
    results, duration = await run_load(url, model, spec, prompts)
    return summarize(results, duration, SLO()), results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=150)
    p.add_argument("--rate", type=float, default=2.8, help="requests/s (Poisson; default 2.8, ~75%% of what two "
                                                            "simulated prefill workers sustain)")
    p.add_argument("--max-jobs", type=int, default=1, help="the queue workers' --prefill-queue-max-jobs (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="30 prompts: a smoke run, numbers not meant to be kept")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--png", type=Path, default=None, help="write the TTFT/ITL CDFs here")
    args = p.parse_args(argv)
    num = 30 if args.quick else args.num_prompts
    prompts = mixed_prompts(num, args.seed)
    spec = LoadSpec(num, INPUT_LEN, OUTPUT_LEN, request_rate=args.rate, seed=args.seed, request_timeout_s=600)
    load_before = os.getloadavg()
    model = str(create_bench_model())
    summaries: dict[str, dict[str, Any]] = {}
    runs: dict[str, list] = {}
    with ExitStack() as stack:
        nats = NatsServer()
        stack.callback(nats.stop)
        backends, _ = start_workers(stack, model, nats.url, args.max_jobs)
        for system in SYSTEMS:
            url = start_proxy(stack, backends, ["--prefill-queue", nats.url] if system == "queue" else [])
            summaries[system], runs[system] = asyncio.run(measure(url, spec, prompts))
    rr, queue = (summaries[s]["ttft_ms"]["p99"] for s in SYSTEMS)
    ratios = {"queue_over_round_robin_ttft_p99": queue / rr if rr and queue is not None else None,
              "queue_over_round_robin_ttft_p50": _ratio(summaries, "p50")}
    print(format_table(summaries, ratios))
    report = {"command": "python -m benchmarks.bench_prefill_queue " + " ".join(argv or sys.argv[1:]),
              "workload": {"num_prompts": num, "rate": args.rate, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                           "prompt_lengths": "log-uniform", "max_jobs": args.max_jobs, "engine": "mock"},
              "load_before": load_before, "load_after": os.getloadavg(), "systems": summaries, "ratios": ratios}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.png:
        plot_distributions(runs, args.png)
    return 0 if all(s["failed"] == 0 for s in summaries.values()) else 1


def _ratio(summaries: dict[str, dict[str, Any]], key: str) -> float | None:
    rr, queue = (summaries[s]["ttft_ms"][key] for s in SYSTEMS)
    return queue / rr if rr and queue is not None else None


if __name__ == "__main__":
    sys.exit(main())
