"""Soak: a 1P1D stack under steady moderate load for a long time; is memory flat, is anything lost?

    python -m benchmarks.soak                          # 30 minutes, 5 of them warm-up
    python -m benchmarks.soak --minutes 60 --json out/soak.json
    python -m benchmarks.soak --quick                  # well under a minute

Starts a prefill worker, a decode worker and the proxy (stack.serving.start_di), then
sends rounds of streamed completions (random prompt lengths, a fixed seed per round, at most
--concurrency in flight) until --minutes have passed. After every round it reads each process's
resident memory (VmRSS) and every worker's KV blocks in use. It reports RSS at the start, at
the end of warm-up and at the end, the growth after warm-up, the requests sent and failed, and
the blocks in use once the load has stopped. RSS is judged flat when it grew after warm-up by
at most --rss-tolerance-mb. JSON (`--json`): `config`, `rounds` (every sample) and `summary`.
Exit status: 0 no failure, no block left in use and RSS flat; 1 the stack could not be used;
3 some requests failed or blocks were left in use; 4 RSS was not flat.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.serving_load import LoadError, LoadSpec, fetch_model, make_requests, run_load
from stack.serving import Stack, StackError, StackOptions, start_di
from stack.worker_metrics import blocks_used, wait_blocks_free


@dataclass(frozen=True, slots=True)
class Sample:
    """The stack after one round of load."""

    round: int
    minutes: float
    sent: int
    failed: int
    rss_mb: dict[str, float]
    blocks_used: dict[str, int]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


def sample(stack: Stack, round_no: int, started: float, sent: int, failed: int) -> Sample:
    return Sample(round_no, (time.monotonic() - started) / 60, sent, failed,
                  {p.name: round(rss_mb(p.proc.pid), 1) for p in stack.processes},
                  {name: blocks_used(url) for name, url in stack.worker_urls.items()})


def soak(stack: Stack, args: argparse.Namespace) -> list[Sample]:
    model = asyncio.run(fetch_model(stack.url))
    started = time.monotonic()
    samples = [sample(stack, 0, started, 0, 0)]
    sent = failed = 0
    round_no = 0
    while time.monotonic() - started < args.minutes * 60:
        round_no += 1
        spec = LoadSpec(num_prompts=args.round_requests, input_len=(args.input_len_min, args.input_len_max),
                        output_len=(args.output_len_min, args.output_len_max),
                        max_concurrency=args.concurrency, seed=round_no, request_timeout_s=120.0)
        results, _ = asyncio.run(run_load(stack.url, model, spec, make_requests(spec)))
        sent += len(results)
        failed += sum(1 for r in results if r.error)
        for stack_process in stack.processes:
            stack_process.check_alive()
        samples.append(sample(stack, round_no, started, sent, failed))
        print(format_sample(samples[-1]), flush=True)
    return samples


def format_sample(s: Sample) -> str:
    rss = "  ".join(f"{name} {mb:.0f}" for name, mb in s.rss_mb.items())
    return f"round {s.round:4d}  {s.minutes:6.1f} min  sent {s.sent:6d}  failed {s.failed:3d}  RSS MB: {rss}"


def summarize(samples: list[Sample], end_blocks: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    warm = next((s for s in samples if s.minutes >= args.warmup_minutes), samples[-1])
    last = samples[-1]
    rss = {name: {"start": samples[0].rss_mb[name], "after_warmup": warm.rss_mb[name], "end": last.rss_mb[name],
                  "growth_after_warmup": round(last.rss_mb[name] - warm.rss_mb[name], 1)}
           for name in last.rss_mb}
    return {"minutes": round(last.minutes, 2), "rounds": last.round, "sent": last.sent, "failed": last.failed,
            "blocks_used_at_end": end_blocks, "warmup_ends_at_round": warm.round, "rss_mb": rss,
            "rss_flat": all(r["growth_after_warmup"] <= args.rss_tolerance_mb for r in rss.values())}


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{summary['minutes']} min, {summary['rounds']} rounds: sent {summary['sent']}, "
             f"failed {summary['failed']}, KV blocks in use at the end {summary['blocks_used_at_end']}",
             f"{'process':<16}{'RSS start':>11}{'warmed up':>11}{'end':>9}{'growth':>9}  (MB)"]
    for name, r in summary["rss_mb"].items():
        lines.append(f"{name:<16}{r['start']:>11.0f}{r['after_warmup']:>11.0f}{r['end']:>9.0f}"
                     f"{r['growth_after_warmup']:>+9.0f}")
    lines.append(f"RSS flat after warm-up (growth <= tolerance): {summary['rss_flat']}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=None, help="length of the run (default 30; --quick 0.4)")
    parser.add_argument("--warmup-minutes", type=float, default=None, help="RSS growth counts after this (default 5)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (default 4)")
    parser.add_argument("--round-requests", type=int, default=None, help="requests per round (default 50)")
    parser.add_argument("--input-len-min", type=int, default=10)
    parser.add_argument("--input-len-max", type=int, default=800)
    parser.add_argument("--output-len-min", type=int, default=1)
    parser.add_argument("--output-len-max", type=int, default=32)
    parser.add_argument("--rss-tolerance-mb", type=float, default=50.0,
                        help="largest RSS growth after warm-up judged flat, per process (default 50)")
    parser.add_argument("--kv-transport", default="shm")
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute with start-up)")
    parser.add_argument("--json", type=Path, help="write the samples and the summary here")
    args = parser.parse_args(argv)
    quick = {"minutes": (30.0, 0.4), "warmup_minutes": (5.0, 0.1), "round_requests": (50, 8)}
    for name, (full, short) in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with start_di(StackOptions(kv_transport=args.kv_transport)) as stack:
            samples = soak(stack, args)
            end_blocks = wait_blocks_free(stack.worker_urls, timeout_s=30.0)
    except (StackError, LoadError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    summary = summarize(samples, end_blocks, args)
    print(format_summary(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "command": shlex.join(["python", "-m", "benchmarks.soak", *(sys.argv[1:] if argv is None else argv)])}
        args.json.write_text(json.dumps({"config": config, "rounds": [asdict(s) for s in samples],
                                         "summary": summary}, indent=1))
    if summary["failed"] or any(summary["blocks_used_at_end"].values()):
        return 3
    return 0 if summary["rss_flat"] else 4


if __name__ == "__main__":
    sys.exit(main())
