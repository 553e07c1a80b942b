"""What the proxy adds: latency and throughput against null backends, with direct calls as baseline.

Starts two null backends (a "prefill" and a "decode" that answer at once) and the proxy
pinned to one core, then, in the same run:
  * latency: one request at a time, alternating direct calls to a backend and calls through
    the proxy (each fanned out to both backends); added = proxy - direct, p50 and p99;
  * throughput: many keep-alive connections to the proxy for a fixed time -> requests/s,
    and the proxy's CPU time per request.
  * the CPU time of one upstream call through the proxy's client (aiohttp), in this process.

    python -m benchmarks.bench_proxy [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from stack.serving import Process, free_port, wait_healthy

BODY = json.dumps({"model": "null", "prompt": "hello", "max_tokens": 2}).encode()


def _request(port: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:" + str(port).encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(BODY)).encode()
            + b"\r\n\r\n" + BODY)


class RawClient:
    """A minimal keep-alive HTTP/1.1 client, so that the load generator costs little CPU."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._request = _request(port)

    async def __aenter__(self) -> RawClient:
        await self._connect()
        return self

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def __aexit__(self, *_: Any) -> None:
        self._writer.close()

    async def post(self) -> int:
        self._writer.write(self._request)
        head = await self._reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await self._reader.readexactly(length)
        if b"\r\nconnection: close" in head.lower():  # servers cap requests per connection
            self._writer.close()
            await self._connect()
        return int(head.split(b" ", 2)[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


async def _latency(direct_port: int, proxy_port: int, count: int) -> tuple[list[float], list[float]]:
    direct, proxied = [], []
    async with RawClient(direct_port) as d, RawClient(proxy_port) as p:
        for _ in range(count):
            for client, out in ((d, direct), (p, proxied)):
                start = time.perf_counter()
                assert await client.post() == 200
                out.append((time.perf_counter() - start) * 1000)
    return direct, proxied


async def _throughput(port: int, connections: int, seconds: float) -> tuple[int, int]:
    done = failed = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, failed
        async with RawClient(port) as client:
            while time.perf_counter() < deadline:
                if await client.post() == 200:
                    done += 1
                else:
                    failed += 1

    await asyncio.gather(*(worker() for _ in range(connections)))
    return done, failed


async def _client_cpu_ms(port: int, calls: int) -> float:
    """CPU time of one upstream call through the proxy's client wrapper, in this process."""
    from proxy.upstream import AiohttpUpstream, Timeouts
    from proxy.workers import WorkerRecord
    upstream = AiohttpUpstream(WorkerRecord("decode", "127.0.0.1", port), Timeouts())
    body = json.loads(BODY)
    try:
        for _ in range(50):
            await upstream.post("/v1/completions", body, {})
        start = time.process_time()
        for _ in range(calls):
            await upstream.post("/v1/completions", body, {})
        return 1000 * (time.process_time() - start) / calls
    finally:
        await upstream.close()


def measure(backends: tuple[int, int], opts: argparse.Namespace, core: int | None) -> dict:
    port = free_port()
    proxy = Process("proxy", ["proxy_server.py", "--host", "127.0.0.1", "--port", str(port),
                              "--prefill-ip", "127.0.0.1", "--prefill-port", str(backends[0]), "--decode-ip", "127.0.0.1",
                              "--decode-port", str(backends[1])], core)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [proxy], timeout_s=30.0)
        asyncio.run(_throughput(port, 8, 1.0))  # warm up connection pools
        direct, proxied = asyncio.run(_latency(backends[1], port, opts.requests))
        cpu0, t0 = _cpu_seconds(proxy.proc.pid), time.perf_counter()
        done, failed = asyncio.run(_throughput(port, opts.connections, opts.seconds))
        cpu, wall = _cpu_seconds(proxy.proc.pid) - cpu0, time.perf_counter() - t0
    finally:
        proxy.stop()
    call_ms = asyncio.run(_client_cpu_ms(backends[1], opts.requests))
    return {"client_cpu_ms_per_call": call_ms, "direct_p50_ms": _pct(direct, 50), "proxy_p50_ms": _pct(proxied, 50),
            "added_p50_ms": _pct(proxied, 50) - _pct(direct, 50), "added_p99_ms": _pct(proxied, 99) - _pct(direct, 99),
            "max_rps": done / wall, "failed": failed, "proxy_cpu_ms_per_request": 1000 * cpu / max(done, 1),
            # On a shared machine the proxy may not get its whole core: requests per CPU-second
            # is what one dedicated core would sustain.
            "rps_per_cpu_second": done / cpu if cpu else 0.0, "proxy_cpu_utilisation": cpu / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description="proxy overhead against null backends")
    parser.add_argument("--quick", action="store_true", help="a short run (< 1 min)")
    parser.add_argument("--json", type=Path, help="write the results here")
    opts = parser.parse_args()
    opts.requests, opts.seconds, opts.connections = (300, 3.0, 32) if opts.quick else (2000, 10.0, 64)
    cores = sorted(os.sched_getaffinity(0))
    # The proxy gets a core of its own; backends and the load generator share the other one.
    proxy_core, other_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    if other_core is not None:
        os.sched_setaffinity(0, {other_core})
    ports = (free_port(), free_port())
    backends = [Process("null backend", ["benchmarks/null_backend.py", "--port", str(p)], other_core) for p in ports]
    try:
        for port in ports:
            wait_healthy(f"http://127.0.0.1:{port}/health", backends, timeout_s=30.0)
        result = measure(ports, opts, proxy_core)
    finally:
        for proc in backends:
            proc.stop()
    _print(result)
    if opts.json:
        opts.json.write_text(json.dumps({**result, "quick": opts.quick,
                                         "proxy_pinned_to_one_core": proxy_core is not None}, indent=2))


def _print(r: dict) -> None:
    print(f"{'direct p50':>11} {'proxy p50':>10} {'added p50':>10} {'added p99':>10} "
          f"{'max req/s':>10} {'CPU ms/req':>11} {'req/CPU-s':>10} {'core use':>9} {'failed':>7} {'call CPU':>9}")
    print(f"{r['direct_p50_ms']:9.3f}ms {r['proxy_p50_ms']:8.3f}ms "
          f"{r['added_p50_ms']:8.3f}ms {r['added_p99_ms']:8.3f}ms {r['max_rps']:10.0f} "
          f"{r['proxy_cpu_ms_per_request']:11.3f} {r['rps_per_cpu_second']:10.0f} "
          f"{r['proxy_cpu_utilisation']:8.0%} {r['failed']:7d} {r['client_cpu_ms_per_call']:7.3f}ms")
    print("added = through the proxy minus direct to one backend; each proxied request is two upstream calls.\n"
          "CPU ms/req = the proxy's CPU time per request; req/CPU-s = what one dedicated core sustains;\n"
          "call CPU = one upstream call through the client alone, measured in the benchmark process.")


if __name__ == "__main__":
    main()
