"""Fixtures: fake workers and the proxy, each a real process on a free loopback port."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import httpx
import pytest

from stack.serving import Process, free_port, wait_healthy
from tests.worker_process import WorkerProcess, start_workers, stop_together


@dataclass
class Server:
    """A started process and the port it serves on."""

    process: Process
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def state(self) -> dict:
        return httpx.get(f"{self.url}/fake/state", timeout=5).json()


def start_fake_worker(role: str, etcd: str | None = None, kv_port: int | None = None,
                      lease_ttl: int = 2, port: int | None = None, draining: bool = False) -> Server:
    port = port or free_port()
    args = ["-m", "tests.proxy.fake_worker", "--role", role, "--port", str(port)]
    args += ["--draining"] if draining else []
    args += ["--etcd", etcd, "--lease-ttl", str(lease_ttl)] if etcd else []
    args += ["--kv-port", str(kv_port)] if kv_port else []
    server = Server(Process(f"fake-{role}", args), port)
    wait_healthy(f"{server.url}/health", [server.process], 30)
    return server


def start_proxy(args: Sequence[str], wait: bool = True) -> Server:
    port = free_port()
    proc = Process("proxy", ["proxy_server.py", "--host", "127.0.0.1", "--port", str(port), *args])
    server = Server(proc, port)
    if wait:
        wait_healthy(f"{server.url}/health", [proc], 30)
    return server


def start_proxies(arg_lists: Sequence[Sequence[str]]) -> list[Server]:
    """Proxies launched at once, then waited for (a start is mostly one core's imports); all are stopped if
    one fails."""
    servers: list[Server] = []
    try:
        servers = [start_proxy(args, wait=False) for args in arg_lists]
        for server in servers:
            wait_healthy(f"{server.url}/health", [server.process], 30)
    except BaseException:
        stop_together(*(server.process for server in servers))
        raise
    return servers


@dataclass
class Pair:
    """Fake 1P1D workers behind a proxy, and a fake single server to compare with."""

    prefill: Server
    decode: Server
    single: Server
    proxy: Server


def _pair(proxy_args: Sequence[str]) -> Iterator[Pair]:
    started: list[Server] = []
    try:
        for role in ("prefill", "decode", "both"):
            started.append(start_fake_worker(role, kv_port=15000 if role == "prefill" else None))
        prefill, decode, single = started
        started.append(start_proxy([
            "--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port), "--prefill-kv-port", "15000",
            "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port),
            "--read-timeout", "2", "--health-interval", "0.5", *proxy_args]))
        yield Pair(prefill, decode, single, started[-1])
    finally:
        for server in started:
            server.process.stop()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    yield from _pair([])


@pytest.fixture(scope="module")
def nixl_pair() -> Iterator[Pair]:
    """The same, with the workers driven by vLLM's NixlConnector handoff."""
    yield from _pair(["--kv-protocol", "nixl"])


@pytest.fixture
def servers() -> Iterator[Callable[[Server], Server]]:
    """Registers servers a test starts itself, and stops them when it ends."""
    started: list[Server] = []
    yield lambda server: started.append(server) or server
    for server in started:
        server.process.stop()


@contextlib.contextmanager
def proxied_2p2d(worker_flags: Sequence[str],
                 proxy_flags: Callable[[list[WorkerProcess]], list[str]]) -> Iterator[tuple[Server, list[WorkerProcess]]]:
    """Two prefill then two decode workers (shm, `worker_flags`) and a proxy started with the flags
    `proxy_flags` makes from them; every process is stopped on the way out."""
    workers: list[WorkerProcess] = []
    proxy: Server | None = None
    try:
        workers = start_workers(*((role, "shm", worker_flags) for role in ("prefill", "prefill", "decode", "decode")))
        proxy = start_proxy(proxy_flags(workers))
        yield proxy, workers
    finally:
        stop_together(proxy.process if proxy is not None else None, *workers)


@contextlib.contextmanager
def proxied_1p1d(decode_flags: Sequence[str] = ()) -> Iterator[tuple[Server, WorkerProcess, WorkerProcess, WorkerProcess]]:
    """A real prefill and decode worker (shm) behind a proxy, and a `both` worker to compare with:
    (proxy, prefill, decode, both); every process is stopped on the way out."""
    started: list[WorkerProcess] = []
    proxy: Server | None = None
    try:
        started = start_workers(*((role, "shm", decode_flags if role == "decode" else ())
                                  for role in ("prefill", "decode", "both")))
        prefill, decode, both = started
        proxy = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                             "--prefill-kv-port", str(prefill.kv_port),
                             "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port)])
        yield proxy, prefill, decode, both
    finally:
        stop_together(proxy.process if proxy is not None else None, *started)
