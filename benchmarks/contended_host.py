"""vLLM 1P1D on a contended host: the commands of docs/vllm.md, a third `vllm serve` kept busy beside them.

    python -m benchmarks.contended_host --json benchmarks/results/contended_host.json
    python -m benchmarks.contended_host --readme-as-before      # without the shared-host settings

Starts, on this machine's cores and unpinned (as the commands of docs/vllm.md do), a
plain `vllm serve` that a background client keeps busy with long prompts, then those vLLM
1P1D commands (prefill and decode `vllm serve` with NeuronConnector, and the proxy), and sends a
16-request mixed load through the proxy, four at a time: completions and chat, greedy and seeded,
streamed and not, prompts of 20-1500 tokens. Every answer must equal the busy server's answer to
the same request (asked one at a time afterwards); a request that fails must fail with a clear
error (an OpenAI error body or event; a failed KV pull as `kv_transfer_error` naming the prefill
peer). Prints each request's outcome, the load average, and the timeline's spans (where the time
of the DI requests went). Exit status 0 when every request was answered exactly, 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from benchmarks.bench_cli import stop_on_sigterm, write_json
from examples.timeline import fetch, span_table
from stack.serving import Stack, StackError, free_port, started, wait_healthy
from stack.vllm_readme import KV_SPACE_GIB, ReadmePorts, readme_commands

NUM_REQUESTS, CONCURRENCY, MAX_TOKENS = 16, 4, 24


def requests(model: str, seed: int = 5) -> list[tuple[str, dict[str, Any]]]:
    """The mixed load: (path, body) of each request."""
    rng = random.Random(seed)
    out = []
    for i in range(NUM_REQUESTS):
        text = "".join(chr(rng.randrange(32, 127)) for _ in range(rng.choice((20, 60, 400, 900, 1500))))
        sampling = {"temperature": 0.0} if i % 2 else {"temperature": 0.8, "seed": 100 + i}
        body = {"model": model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": i % 4 < 2, **sampling}
        if i % 3 == 0:
            out.append(("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}))
        else:
            out.append(("/v1/completions", {**body, "prompt": text}))
    return out


async def ask(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request's outcome: its text, or its status and error (type and message)."""
    started = time.perf_counter()
    try:
        reply = await client.post(url + path, json=body)
    except httpx.HTTPError as exc:
        return {"status": None, "error_type": type(exc).__name__, "error": str(exc)}
    outcome: dict[str, Any] = {"status": reply.status_code, "seconds": round(time.perf_counter() - started, 3)}
    if reply.status_code != 200:
        error = _error(reply.content)
        return {**outcome, "error_type": error.get("type"), "error": error.get("message", reply.text[:300])}
    if not body["stream"]:
        choice = reply.json()["choices"][0]
        return {**outcome, "text": choice["text"] if "text" in choice else choice["message"]["content"]}
    text = ""
    for line in reply.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return {**outcome, "error_type": chunk["error"].get("type"), "error": chunk["error"].get("message")}
        for choice in chunk.get("choices") or []:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return {**outcome, "text": text}


def _error(content: bytes) -> dict[str, Any]:
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


async def run_load(url: str, load: list[tuple[str, dict[str, Any]]], concurrency: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(path: str, body: dict[str, Any]) -> dict[str, Any]:
            async with gate:
                return await ask(client, url, path, body)
        return list(await asyncio.gather(*(one(p, b) for p, b in load)))


async def keep_busy(url: str, model: str, stop: asyncio.Event, concurrency: int = 2) -> int:
    """Long prompts to `url` until `stop` is set; the number of requests it answered."""
    done = 0
    rng = random.Random(99)
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker() -> None:
            nonlocal done
            while not stop.is_set():
                prompt = [rng.randint(32, 126) for _ in range(1500)]
                reply = await client.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 64, "ignore_eos": True, "temperature": 0})
                done += reply.status_code == 200
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


async def measure(stack: Stack, busy_url: str, model: str) -> dict[str, Any]:
    load = requests(model)
    stop = asyncio.Event()
    busy = asyncio.ensure_future(keep_busy(busy_url, model, stop))
    await asyncio.sleep(5)   # the busy server is busy before the DI load starts
    started = time.perf_counter()
    got = await run_load(stack.url, load, CONCURRENCY)
    seconds = time.perf_counter() - started
    stop.set()
    busy_done = await busy
    want = await run_load(busy_url, load, 1)
    for outcome, reference, (path, body) in zip(got, want, load):
        outcome.update(endpoint=path, stream=body["stream"], seeded="seed" in body,
                       exact=outcome.get("text") is not None and outcome.get("text") == reference.get("text"))
    return {"requests": got, "load_seconds": round(seconds, 2), "busy_requests_answered": busy_done}


def summary(result: dict[str, Any]) -> str:
    rows = [f"{'#':>3} {'endpoint':22} {'stream':6} {'seeded':6} {'status':6} {'exact':5} {'s':>6}  error"]
    for i, r in enumerate(result["requests"]):
        rows.append(f"{i:3d} {r['endpoint']:22} {str(r['stream']):6} {str(r['seeded']):6} {str(r['status']):6} "
                    f"{str(r['exact']):5} {r.get('seconds', 0):6.2f}  {r.get('error_type') or ''} "
                    f"{(r.get('error') or '')[:120]}")
    exact = sum(r["exact"] for r in result["requests"])
    rows.append(f"\n{exact}/{len(result['requests'])} answered exactly in {result['load_seconds']} s; "
                f"load average before {result['loadavg_before']}, after {result['loadavg_after']}")
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.contended_host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the ~24M benchmark model)")
    p.add_argument("--readme-as-before", action="store_true",
                   help="the commands of docs/vllm.md without the shared-host settings (what failed before)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, metavar="PATH")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    from worker.model.bench_model import create_bench_model   # torch: only once the command line is good

    model = str(Path(args.model).resolve()) if args.model else str(create_bench_model())
    ports = ReadmePorts(proxy=free_port(), prefill=free_port(), decode=free_port(), kv=free_port(),
                        decode_status=free_port(), prefill_status=free_port())
    busy_port = free_port()
    before = os.getloadavg()

    def build(stack: Stack) -> None:
        # Another user's server on the same host, given its share of the memory as docs/vllm.md says.
        stack.start("busy vllm", ["-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(busy_port),
                                  "--uvicorn-log-level", "warning"], env={"VLLM_CPU_KVCACHE_SPACE": KV_SPACE_GIB})
        for name, command, env in readme_commands(model, ports, shared_host=not args.readme_as_before):
            # `vllm` and `python` of this interpreter's environment, as in an activated venv
            program = sys.executable if command[0] == "python" else str(Path(sys.executable).with_name(command[0]))
            stack.start(name, command[1:], env=env, program=program)
        try:
            for port in (busy_port, ports.prefill, ports.decode):
                wait_healthy(f"http://127.0.0.1:{port}/health", stack.processes, args.startup_timeout)
            stack.url = f"http://127.0.0.1:{ports.proxy}"
            wait_healthy(f"{stack.url}/ready", stack.processes, args.startup_timeout)
        except StackError:
            for process in stack.processes:
                print(f"--- {process.name}:\n{process.tail(6000)}", file=sys.stderr)
            raise

    with started(build) as stack:
        served = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
        result = asyncio.run(measure(stack, f"http://127.0.0.1:{busy_port}", served))
        urls = {"proxy": stack.url, "prefill": f"http://127.0.0.1:{ports.prefill_status}",
                "decode": f"http://127.0.0.1:{ports.decode_status}"}
        timelines = fetch(urls, None, 100)
    result.update(loadavg_before=[round(x, 2) for x in before], loadavg_after=[round(x, 2) for x in os.getloadavg()],
                  readme_as_before=args.readme_as_before, commands=[" ".join(c) for _, c, _ in
                                                                    readme_commands(model, ports, not args.readme_as_before)],
                  spans=span_table(timelines), timelines=timelines,
                  command=" ".join(["python", "-m", "benchmarks.contended_host", *(argv or sys.argv[1:])]))
    print(summary(result) + "\n\n" + result["spans"])
    write_json(args.json, result)
    return 0 if all(r["exact"] for r in result["requests"]) else 1


if __name__ == "__main__":
    sys.exit(main())
