"""A fleet of simulated workers behind the proxy over etcd, for the phase-change benchmark: started once,
its split set by role flips, and the open-loop replay of a trace against it."""
from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import httpx

from benchmarks.phase_change import CUT, MOCK_COSTS, Arrival
from benchmarks.serving_load import completion_body, stream_body
from benchmarks.serving_metrics import RequestResult
from proxy.flows import DEFAULT_STRATEGY
from stack.etcd import EtcdServer
from stack.nats import NatsServer
from stack.serving import Process, free_port, wait_healthy
from stack.worker_fleet import start_workers

MODEL = "neuron-di-builtin"


def mock_worker_flags() -> list[str]:
    """The simulated engine every worker of the benchmark runs (the planner's template adds the same)."""
    return ["--engine", "mock", "--kv-transport", "shm", "--num-kv-blocks", "8192", "--max-num-seqs", "16",
            "--drain-timeout", "120", "--etcd-ttl", "3", "--threads", "1",
            "--mock-prefill-tokens-per-s", str(MOCK_COSTS["prefill_tokens_per_s"]),
            "--mock-decode-base-ms", str(MOCK_COSTS["decode_base_ms"]),
            "--mock-decode-per-seq-ms", str(MOCK_COSTS["decode_per_seq_ms"])]


@dataclass
class MockFleet:
    """etcd, `size` simulated workers (all decode at first) and the proxy (its --routing `routing`); `close()`
    stops them all. With `prefill_queue`, a nats-server too: prefill legs wait in the global prefill queue
    (each worker takes one job at a time) instead of on the worker the proxy picked. With `move_streams`, a
    worker that changes role or drains hands its running streams back, their KV held for the pull, and the proxy
    resumes them on another decode worker, instead of the worker finishing them first. `flow`: the proxy's
    --disaggregation-strategy."""

    size: int
    routing: str = "least_loaded"
    prefill_queue: bool = False
    move_streams: bool = False
    flow: str = DEFAULT_STRATEGY
    etcd: EtcdServer = field(init=False)
    nats: NatsServer | None = None
    workers: list[tuple[Process, str]] = field(default_factory=list)   # (process, its URL)
    proxy: Process | None = None
    proxy_url: str = ""

    def __post_init__(self) -> None:
        self.etcd = EtcdServer()
        try:
            self.nats = NatsServer() if self.prefill_queue else None
            self.workers = start_workers(self.size, lambda _, port, kv_port: (f"worker-{port}", [
                "-m", "worker", "--role", "decode", "--port", str(port), "--kv-port", str(kv_port),
                "--etcd", self.etcd.endpoint, *self.worker_flags()]))
            port = free_port()
            self.proxy = Process("proxy", ["proxy_server.py", "--host", "127.0.0.1", "--port", str(port),
                                           "--etcd", self.etcd.endpoint, "--health-interval", "1",
                                           "--health-timeout", "10", "--routing", self.routing,
                                           "--disaggregation-strategy", self.flow,
                                           *self._queue_flags(), *(["--resume-streams"] if self.move_streams else [])])
            self.proxy_url = f"http://127.0.0.1:{port}"
            wait_healthy(f"{self.proxy_url}/health", [self.proxy], 60)
        except BaseException:
            self.close()
            raise

    def worker_flags(self) -> list[str]:
        """What every worker of this fleet runs with beside its role, ports and etcd."""
        return [*mock_worker_flags(), *self._queue_flags(),
                *(["--drain-hands-back-streams", "--hand-back-kv-port", "0"] if self.move_streams else [])]

    def worker_template(self) -> str:
        """The planner's --worker-command for new workers of this fleet."""
        return " ".join([sys.executable, "-m", "worker", "--role", "{role}", "--port", "{port}",
                         "--kv-port", "{kv_port}", "--etcd", "{etcd}", *self.worker_flags()])

    def _queue_flags(self) -> list[str]:
        return [] if self.nats is None else ["--prefill-queue", self.nats.url]

    def healths(self) -> dict[str, dict]:
        """URL -> GET /health of every worker that answers and does not drain."""
        bodies = {}
        for _, url in self.workers:
            try:
                body = httpx.get(f"{url}/health", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            if not body.get("draining"):
                bodies[url] = body
        return bodies

    def set_split(self, prefill: int, timeout_s: float = 180.0, attempts: int = 3) -> None:
        """Flips workers until `prefill` of them are prefill workers and the rest decode, and the proxy
        sees that split healthy. A worker whose change of role failed is asked again, `attempts` times in all."""
        urls = [url for process, url in self.workers if process.proc.poll() is None]
        want = {url: "prefill" if i < prefill else "decode" for i, url in enumerate(urls)}
        asked: Counter[str] = Counter()
        deadline = time.monotonic() + timeout_s
        wanted = {"prefill": prefill, "decode": len(urls) - prefill}
        while True:
            healths = self.healths()
            wrong = {url: healths.get(url) for url, role in want.items()
                     if healths.get(url, {}).get("worker", {}).get("role") != role}
            if not wrong and self.proxy_counts() == wanted:
                return
            for url, health in wrong.items():
                if health is not None and "changing_role" not in health and asked[url] < attempts:
                    asked[url] += 1
                    httpx.post(f"{url}/role", json={"role": want[url]}, timeout=10).raise_for_status()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not reach {prefill}P{len(urls) - prefill}D; off it: " + "; ".join(
                    f"{url}: {(h or {}).get('last_role_change', 'no answer')}" for url, h in wrong.items()))
            time.sleep(0.2)

    def proxy_counts(self) -> dict[str, int]:
        counts = httpx.get(f"{self.proxy_url}/health", timeout=5).json()["workers"]
        return {role: counts[role]["healthy"] for role in ("prefill", "decode")}

    def drain_registered(self, urls: Sequence[str]) -> None:
        """Drains workers the benchmark did not start (the planner's): they exit by themselves."""
        for url in urls:
            try:
                httpx.post(f"{url}/drain", timeout=5)
            except httpx.HTTPError:
                pass

    def close(self) -> None:
        for process in [self.proxy] + [p for p, _ in self.workers]:
            if process is not None:
                process.stop(timeout_s=20)
        if self.nats is not None:
            self.nats.stop()
        self.etcd.stop()


async def replay(proxy_url: str, arrivals: Sequence[Arrival], grace_s: float) -> list[RequestResult]:
    """Sends each arrival at its offset (open loop), streamed; requests still running `grace_s` after the
    last arrival are cut and judged on what they received."""
    url = proxy_url.rstrip("/") + "/v1/completions"
    results = [RequestResult(len(a.request.prompt_token_ids), a.request.output_len) for a in arrivals]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def send(arrival: Arrival, result: RequestResult) -> None:
            await asyncio.sleep(max(0.0, t0 + arrival.offset_s - time.perf_counter()))
            await stream_body(client, url, completion_body(MODEL, arrival.request), result, 600.0)

        tasks = [asyncio.ensure_future(send(a, r)) for a, r in zip(arrivals, results)]
        end = max((a.offset_s for a in arrivals), default=0.0) + grace_s
        await asyncio.wait(tasks, timeout=max(0.0, t0 + end - time.perf_counter()))
        for task, result in zip(tasks, results):
            if not task.done():
                task.cancel()
                result.error, result.end = CUT, time.perf_counter()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results
