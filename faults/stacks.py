"""The stacks a fault campaign breaks: static 1P1D, and 2P2D whose workers register in a real etcd
(the two-host 1P1D is faults/two_hosts.py's).

Each is a stack.serving.Stack whose processes can be killed (SIGKILL, mid-load) and restarted
with the same command line and ports, so the others keep running and the proxy's view of the
workers is the one it would have in production.
"""
from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aetcd

from proxy.discovery import read_workers
from stack.etcd import etcd_args, etcd_binary
from stack.serving import (Stack, StackError, StackOptions, free_port, proxy_args, started, wait_healthy,
                           worker_args)

if TYPE_CHECKING:
    from faults.netns_hosts import Cable, TwoHosts

# A decode worker killed mid-request never pulls what its prefill peer holds: the prefill frees it at
# its abort timeout. Short here, so a leak check waits seconds, not the default minute.
ABORT_TIMEOUT_S = 10
# A pull whose lookup is outstanding when it is cancelled (its prefill peer was killed, say) keeps
# its blocks until its deadline plus the connector's 5 s grace: the peer might still be writing.
PULL_TIMEOUT_S = 20
PULL_HOLD_S = PULL_TIMEOUT_S + 5
ETCD_TTL_S = 2
# Streams move off a lost or drained decode worker (docs/stream-moves.md), and a request whose leg was lost before
# it answered goes again to survivors (docs/faults.md), as a production stack would run.
FAULT_OPTIONS = StackOptions(kv_transport="tcp",  # a killed shm worker cannot unlink its pool
                             worker_extra=("--kv-abort-timeout", str(ABORT_TIMEOUT_S),
                                           "--kv-pull-timeout", str(PULL_TIMEOUT_S), "--drain-hands-back-streams"),
                             proxy_extra=("--resume-streams", "--resend-lost-legs", "2"))


@dataclass
class FaultStack:
    """A started stack, what its processes are, and how to tell each of them is serving again."""

    stack: Stack
    topology: str                                              # "1p1d", "2p2d" or "two_hosts"
    health_urls: dict[str, str] = field(default_factory=dict)  # process name -> URL answering 200 when up
    etcd: str = ""                                             # host:port of etcd, 2p2d only
    etcd_data: str = ""
    hosts: TwoHosts | None = None                              # the namespaces it runs in, two_hosts only

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def link(self) -> Cable:
        """The cable between the two hosts (two_hosts only)."""
        assert self.hosts is not None, f"a {self.topology} stack has no cable"
        return self.hosts.link

    def names(self, kind: str) -> list[str]:
        """The processes of one kind ("prefill", "decode", "proxy", "etcd"), in start order."""
        return [p.name for p in self.stack.processes if p.name.startswith(kind)]

    def kill(self, name: str) -> None:
        self.stack.process(name).kill()

    def drain(self, name: str, timeout_s: float = 120.0) -> int:
        """SIGTERM to the process `name` (a worker drains: it leaves, finishes what it holds, exits); its exit status."""
        process = self.stack.process(name)
        process.proc.send_signal(signal.SIGTERM)
        return process.proc.wait(timeout=timeout_s)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Starts the killed process `name` again and waits until it answers its health check."""
        process = self.stack.restart(name)
        wait_healthy(self.health_urls[name], [process], timeout_s)

    def registered(self) -> int:
        """How many workers are registered in etcd right now (0 when it cannot be read)."""
        host, _, port = self.etcd.rpartition(":")

        async def read() -> int:
            async with aetcd.Client(host, int(port), timeout=2) as client:
                return len((await read_workers(client))[0])
        try:
            return asyncio.run(read())
        except Exception:  # noqa: BLE001 - etcd down or restarting: nobody is registered as far as we know
            return 0

    def close(self) -> None:
        self.stack.__exit__(None, None, None)
        if self.etcd_data:
            shutil.rmtree(self.etcd_data, ignore_errors=True)
        if self.hosts is not None:
            self.hosts.__exit__(None, None, None)

    def __enter__(self) -> FaultStack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_1p1d(options: StackOptions = FAULT_OPTIONS) -> FaultStack:
    """A prefill and a decode worker, the proxy given their addresses on its command line."""
    faults = FaultStack(Stack(), "1p1d")

    def build(stack: Stack) -> None:
        faults.stack = stack
        prefill, kv_port, decode = free_port(), free_port(), free_port()
        _worker(faults, "prefill worker", worker_args("prefill", prefill, options, kv_port), prefill)
        _worker(faults, "decode worker", worker_args("decode", decode, options), decode)
        _wait_workers(faults, options)
        _proxy(faults, ["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill),
                        "--decode-ip", "127.0.0.1", "--decode-port", str(decode)], options)

    started(build)
    return faults


def start_2p2d(options: StackOptions = FAULT_OPTIONS) -> FaultStack:
    """etcd, two prefill and two decode workers registered in it, and the proxy discovering them."""
    faults = FaultStack(Stack(), "2p2d", etcd_data=tempfile.mkdtemp(prefix="neuron-di-etcd-"))

    def build(stack: Stack) -> None:
        faults.stack = stack
        _etcd(faults, options)
        registration = ["--etcd", faults.etcd, "--etcd-ttl", str(ETCD_TTL_S)]
        for i in range(2):
            prefill, kv_port, decode = free_port(), free_port(), free_port()
            _worker(faults, f"prefill worker {i}", [*worker_args("prefill", prefill, options, kv_port),
                                                    *registration], prefill)
            _worker(faults, f"decode worker {i}", [*worker_args("decode", decode, options), *registration], decode)
        _wait_workers(faults, options)
        _proxy(faults, ["--etcd", faults.etcd, "--health-interval", "0.5"], options)
        _wait_registered(faults, 4, options.startup_timeout_s)

    try:
        started(build)
    except BaseException:
        shutil.rmtree(faults.etcd_data, ignore_errors=True)
        raise
    return faults


def _worker(faults: FaultStack, name: str, args: list[str], port: int) -> None:
    """Starts a worker; the workers of a stack load their models at the same time."""
    url = f"http://127.0.0.1:{port}"
    faults.stack.start(name, args)
    faults.stack.worker_urls[name] = url
    faults.health_urls[name] = f"{url}/health"


def _wait_workers(faults: FaultStack, options: StackOptions) -> None:
    for name in faults.stack.worker_urls:
        wait_healthy(faults.health_urls[name], faults.stack.processes, options.startup_timeout_s)


def _proxy(faults: FaultStack, backends: list[str], options: StackOptions) -> None:
    port = free_port()
    faults.stack.start("proxy", [*proxy_args(port, backends), *options.proxy_extra])
    faults.stack.url = f"http://127.0.0.1:{port}"
    faults.health_urls["proxy"] = f"{faults.stack.url}/ready"
    wait_healthy(faults.health_urls["proxy"], faults.stack.processes, options.startup_timeout_s)


def _etcd(faults: FaultStack, options: StackOptions) -> None:
    port = free_port()
    faults.etcd = f"127.0.0.1:{port}"
    faults.stack.start("etcd", etcd_args("faults", faults.etcd_data, port), program=etcd_binary(),
                       service=True)
    faults.health_urls["etcd"] = f"http://{faults.etcd}/health"
    wait_healthy(faults.health_urls["etcd"], faults.stack.processes, options.startup_timeout_s)


def _wait_registered(faults: FaultStack, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while faults.registered() < count:
        if time.monotonic() > deadline:
            raise StackError(f"fewer than {count} workers registered in etcd after {timeout_s:g} s")
        time.sleep(0.2)
