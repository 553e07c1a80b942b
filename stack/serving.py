"""Our serving stacks, each worker pinned to its own core (or not: `StackOptions.cores`), and the one way
tests, benchmarks, the fault campaign and examples start a process (`Process`).

(a) DI 1P1D: a prefill worker on one core, a decode worker on the other, the proxy in DI mode.
(b) colocated: two `both` workers, one per core, behind the same proxy in round-robin mode.
(c) one `both` worker alone, no proxy, for comparing the engine with another server.
The proxy is left unpinned in both, so both stacks get the same cores for the same jobs.
Every process is started in its own session and stopped (SIGTERM, then SIGKILL) on the way
out, also when startup fails or the run is interrupted; every wait has a deadline.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import httpx

ROOT = Path(__file__).resolve().parent.parent
STACK_DRAIN_TIMEOUT_S = 5  # seconds; see worker_args


class StackError(RuntimeError):
    """A process of the stack exited or did not become healthy in time."""


@dataclass(frozen=True, slots=True)
class StackOptions:
    """What every worker of both stacks shares."""

    cores: tuple[int | None, int | None] = (None, None)  # None: not pinned
    model: str | None = None
    kv_transport: str = "shm"
    startup_timeout_s: float = 120.0
    worker_extra: tuple[str, ...] = ()  # more flags for every worker, whatever its role
    threads: int = 1                    # torch intra-op threads of every worker
    proxy_extra: tuple[str, ...] = ()   # more flags for the proxy


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_was_taken(exc: StackError) -> bool:
    """Whether a process exited because a port picked for it with `free_port` was taken before it bound it (by
    an outgoing connection of any process, say): Python says "Address already in use", Go (etcd) "address
    already in use". Such a process may be started again on new ports."""
    return "address already in use" in str(exc).lower()


def worker_args(role: str, port: int, options: StackOptions, kv_port: int | None = None,
                host: str = "127.0.0.1") -> list[str]:
    """The worker command line for one role; the DI flags live here and nowhere else."""
    # A stack stops all its processes at once: a worker's drain has nobody to hand its requests to, so it
    # is kept as short as a plain shutdown's grace (`worker_extra` may say otherwise).
    args = ["-m", "worker", "--role", role, "--host", host, "--port", str(port), "--threads", str(options.threads),
            "--drain-timeout", str(STACK_DRAIN_TIMEOUT_S)]
    if role != "both":
        args += ["--kv-transport", options.kv_transport]
    if kv_port is not None:
        args += ["--kv-port", str(kv_port)]
    if options.model:
        args += ["--model", options.model]
    return args + list(options.worker_extra)


def proxy_args(port: int, backends: Sequence[str], host: str = "127.0.0.1") -> list[str]:
    # A worker busy with a long prefill on its one core answers health checks late; the benchmark
    # measures that latency, so the proxy must not take the worker out of rotation for it.
    return ["proxy_server.py", "--host", host, "--port", str(port), "--health-timeout", "30", *backends]


class Child(Protocol):
    """What `Process` needs of its child: the part of `subprocess.Popen` it uses."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Process:
    """A child (Python unless `program` says otherwise) in its own session, optionally pinned to
    one core, logging to a temp file; `stop()` ends it (SIGTERM, then SIGKILL) and removes the log,
    whose text `output()` still gives.

    It runs from the repo root with the repo on its PYTHONPATH. `prefix` runs it through a launcher
    that execs it in turn (e.g. `ip netns exec NAME`), so the child's pid and session are still the
    program's own.
    """

    def __init__(self, name: str, args: Sequence[str], core: int | None = None,
                 env: dict[str, str] | None = None, program: str = sys.executable,
                 prefix: Sequence[str] = ()) -> None:
        self.name, self.args, self.core, self.env = name, list(args), core, env
        self.program, self.prefix = program, list(prefix)
        log_name = f"neuron-di-{name}-".replace(" ", "-")
        self.log = tempfile.NamedTemporaryFile(prefix=log_name, suffix=".log", delete=False)
        self._output: str | None = None   # the log's text once it is removed
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: Child = self._start([*prefix, program, *args], env)

    def _start(self, argv: list[str], env: dict[str, str]) -> Child:
        """Launches the child (the tests fork some of ours from a warm server instead: tests/warm_start.py)."""
        # Pinned in the child before exec, so no thread of it ever runs on another core.
        core = self.core
        pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=pin)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """Everything it has written so far (all it wrote, once stopped)."""
        if self._output is not None:
            return self._output
        return Path(self.log.name).read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise StackError(f"the {self.name} exited with status {self.proc.returncode}:\n{self.tail()}")

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL to the whole session: no handler runs, nothing is cleaned up."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=timeout_s)

    def again(self) -> Process:
        """The same command started anew (same name, ports, core), its log in a new file."""
        return Process(self.name, self.args, self.core, self.env, self.program, self.prefix)

    def terminate(self) -> None:
        """SIGTERM to the whole session, not waiting: `stop()` then waits (see `stop_all`)."""
        if not self.log.closed and self.proc.poll() is None:
            self._signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.log.closed:
            return  # stopped already
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        self.log.close()
        self._output = self.output()
        os.unlink(self.log.name)

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def stop_all(processes: Sequence[Process]) -> None:
    """Stops `processes` together: SIGTERM to each, then waits for each (a stop is mostly waiting for an exit,
    so N stops take about as long as one); one failing stop does not skip the rest."""
    for process in processes:
        process.terminate()
    with ExitStack() as stops:
        for process in reversed(processes):
            stops.callback(process.stop)


def wait_healthy(url: str, processes: Sequence[Process] = (), timeout_s: float = 60.0) -> None:
    """Polls GET url until 200; fails at once if any of `processes` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in processes:
            process.check_alive()
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    logs = "".join(f"\n--- {p.name}:\n{p.tail(1500)}" for p in processes)
    raise StackError(f"{url} was not healthy after {timeout_s:g} s{logs}")


class Stack:
    """A started stack (context manager): `url` is the proxy's; leaving stops every process."""

    def __init__(self) -> None:
        self.url = ""
        self.worker_urls: dict[str, str] = {}  # process name -> its HTTP address
        self.kv_ports: dict[str, int] = {}     # prefill process name -> its signal-plane port
        self.status_urls: dict[str, str] = {}  # worker process name -> where its GET /timeline answers
        self.processes: list[Process] = []  # in start order; stopped in reverse
        self.services: set[str] = set()     # names of processes the others use (etcd): stopped after them

    def start(self, name: str, args: Sequence[str], core: int | None = None,
              env: dict[str, str] | None = None, program: str = sys.executable,
              prefix: Sequence[str] = (), service: bool = False) -> Process:
        process = Process(name, args, core, env, program, prefix)
        if service:
            self.services.add(name)
        self.processes.append(process)
        return process

    def timeline_urls(self) -> dict[str, str]:
        """Where the proxy and each worker answer GET /timeline (a vLLM worker: its connector's status server)."""
        return {"proxy": self.url, **{name: self.status_urls.get(name, url) for name, url in self.worker_urls.items()}}

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def restart(self, name: str) -> Process:
        """Replaces the (stopped or killed) process `name` by the same command started anew."""
        old = self.process(name)
        old.stop()
        new = old.again()
        self.processes[self.processes.index(old)] = new  # its place in the stop order too
        return new

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Stops the processes together, except services (etcd): those stop once the rest has exited, since a
        stopping worker still leaves them."""
        services = [p for p in self.processes if p.name in self.services]
        stop_all([p for p in reversed(self.processes) if p not in services])
        stop_all(services[::-1])


def start_di(options: StackOptions) -> Stack:
    """(a): prefill on cores[0], decode on cores[1], the proxy in DI mode."""
    def build(stack: Stack) -> None:
        prefill_port, kv_port, decode_port = free_port(), free_port(), free_port()
        stack.start("prefill worker", worker_args("prefill", prefill_port, options, kv_port), options.cores[0])
        stack.start("decode worker", worker_args("decode", decode_port, options), options.cores[1])
        stack.worker_urls = {"prefill worker": f"http://127.0.0.1:{prefill_port}",
                             "decode worker": f"http://127.0.0.1:{decode_port}"}
        _wait_workers(stack, [prefill_port, decode_port], options)
        # No --prefill-kv-port: the proxy reads the prefill worker's from its GET /health answer.
        start_proxy(stack, ["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill_port),
                             "--decode-ip", "127.0.0.1", "--decode-port", str(decode_port)], options)

    return started(build)


def start_colocated(options: StackOptions) -> Stack:
    """(b): a `both` worker on each core, the proxy round-robins over them."""
    def build(stack: Stack) -> None:
        ports = [free_port() for _ in options.cores]
        for i, (port, core) in enumerate(zip(ports, options.cores)):
            stack.start(f"worker {i}", worker_args("both", port, options), core)
        _wait_workers(stack, ports, options)
        start_proxy(stack, ["--mode", "colocated", *[a for p in ports for a in ("--worker", f"127.0.0.1:{p}")]],
                     options)

    return started(build)


def start_both(options: StackOptions, extra: Sequence[str] = ()) -> Stack:
    """One `both` worker on cores[0], no proxy: `url` is the worker's own. `extra` goes on its
    command line after the default flags (engine settings a user adds)."""
    def build(stack: Stack) -> None:
        port = free_port()
        stack.start("worker", [*worker_args("both", port, options), *extra], options.cores[0])
        stack.url = stack.worker_urls["worker"] = f"http://127.0.0.1:{port}"
        _wait_workers(stack, [port], options)

    return started(build)


def started(build: Callable[[Stack], None]) -> Stack:
    """A stack built by `build`; if building fails or is interrupted, what it started is stopped."""
    stack = Stack()
    try:
        build(stack)
    except BaseException:
        stack.__exit__(None, None, None)
        raise
    return stack


def _wait_workers(stack: Stack, ports: Sequence[int], options: StackOptions) -> None:
    for port in ports:
        wait_healthy(f"http://127.0.0.1:{port}/health", stack.processes, options.startup_timeout_s)


def start_proxy(stack: Stack, backends: list[str], options: StackOptions) -> None:
    """Starts the proxy and waits until it is ready: a healthy worker of every role behind it."""
    port = free_port()
    stack.start("proxy", proxy_args(port, [*backends, *options.proxy_extra]))
    stack.url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{stack.url}/ready", stack.processes, options.startup_timeout_s)
