"""Worker processes on this host, started from a command template and stopped by a graceful drain.

The template is one command line with `{role}`, `{port}` and `{kv_port}` (free ports on 127.0.0.1) and
`{etcd}`, e.g. `python -m worker --role {role} --port {port} --kv-port {kv_port} --etcd {etcd}` (or a
`vllm serve ...` line). A started worker counts from its start, so the budget is never passed; one that
exits or is not registered in etcd within the start timeout is stopped and started again after a
backoff that doubles (up to a minute). A worker is stopped only by POST /drain: it finishes what it
runs and exits by itself. Processes run in their own session: they outlive the planner, and a planner
restarted finds them in etcd (and those still starting in its state file).
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import httpx

from common.pid import pid_alive
from planner.actions import Action
from planner.connectors.flip import RoleFlipper
from planner.errors import ConfigError, ConnectorError
from planner.fleet import EtcdWorkers, Fleet, Member, merge

log = logging.getLogger("planner.local")
FIRST_BACKOFF_S = 2.0
MAX_BACKOFF_S = 60.0
PLACEHOLDERS = ("role", "port", "kv_port", "etcd")


@dataclass
class Start:
    member: Member      # state "starting"
    pid: int
    deadline: float     # wall clock
    log_path: str


def check_template(template: str) -> None:
    """ConfigError naming --worker-command unless it is a command line with known placeholders, {port} among them."""
    try:
        shlex.split(template.format(**{name: "x" for name in PLACEHOLDERS}))
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"--worker-command {template!r}: {exc!r} (placeholders: "
                          f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)})") from exc
    if "{port}" not in template:
        raise ConfigError(f"--worker-command {template!r} must place the worker's HTTP port with {{port}}")


class LocalConnector:
    """Starts and drains worker processes; flips roles too unless `flipper` is None."""

    def __init__(self, etcd: EtcdWorkers, template: str, budget: int, start_timeout_s: float,
                 flipper: RoleFlipper | None, log_dir: str | None = None) -> None:
        check_template(template)
        self.etcd, self.template, self.budget = etcd, template, budget
        self.start_timeout_s = start_timeout_s
        self.flipper = flipper
        self.can_flip = flipper is not None
        self.can_scale = True
        self.log_dir = log_dir or tempfile.gettempdir()
        self.client = httpx.AsyncClient(timeout=10.0)
        self.starting: dict[str, Start] = {}
        self.stopping: dict[str, Member] = {}
        self.failures = 0
        self.next_start_at = 0.0

    async def fleet(self) -> Fleet:
        changing = [s.member for s in self.starting.values()] + list(self.stopping.values())
        if self.flipper is not None:
            changing += [f.member for f in self.flipper.flips.values()]
        return merge(await self.etcd.read(), changing)

    async def apply(self, actions: list[Action]) -> None:
        for action in actions:
            if action.kind == "flip" and self.flipper is not None:
                await self.flipper.flip(action)
            elif action.kind == "stop":
                await self._stop(action)
            elif action.kind == "start":
                await self._start(action.role)

    async def _start(self, role: str) -> None:
        fleet = await self.fleet()
        if fleet.counts().total >= self.budget:
            log.warning("not starting a %s worker: %s already count against the budget of %d",
                        role, fleet.counts(), self.budget)
            return
        if time.time() < self.next_start_at:
            log.info("not starting a %s worker yet: backing off for %.0f s after %d failed starts",
                     role, self.next_start_at - time.time(), self.failures)
            return
        port = _free_port()
        command = shlex.split(self.template.format(role=role, port=port, kv_port=_free_port(),
                                                   etcd=f"{self.etcd.host}:{self.etcd.port}"))
        log_path = os.path.join(self.log_dir, f"neuron-di-planner-{role}-{port}.log")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        member = Member(f"127.0.0.1:{port}", role, "starting")
        self.starting[member.address] = Start(member, proc.pid, time.time() + self.start_timeout_s, log_path)
        log.info("started a %s worker on port %d (pid %d, log %s)", role, port, proc.pid, log_path)

    async def _stop(self, action: Action) -> None:
        assert action.member is not None
        try:
            reply = await self.client.post(f"{action.member.url}/drain")
        except httpx.HTTPError as exc:
            raise ConnectorError(f"{action}: {exc}") from exc
        if reply.status_code != 202:
            raise ConnectorError(f"{action}: HTTP {reply.status_code} {reply.text[:200]}")
        log.info("%s: draining", action)
        self.stopping[action.member.address] = Member(action.member.address, action.role, "stopping")

    def restore(self, flips: list, starts: list[Start]) -> None:
        self.starting.update({s.member.address: s for s in starts})
        if self.flipper is not None:
            self.flipper.restore(flips)

    def under_way(self) -> tuple[list, list[Start]]:
        return (self.flipper.under_way()[0] if self.flipper is not None else []), list(self.starting.values())

    async def progress(self) -> None:
        if self.flipper is not None:
            await self.flipper.progress()
        registered = {r.address for r in await self.etcd.read()}
        for address, start in list(self.starting.items()):
            if address in registered:
                log.info("%s worker %s registered", start.member.role, address)
                del self.starting[address]
                self.failures, self.next_start_at = 0, 0.0
            elif not _alive(start.pid) or time.time() > start.deadline:
                del self.starting[address]
                self._failed(start, "exited" if not _alive(start.pid) else "did not register in time")
        for address, member in list(self.stopping.items()):
            if address not in registered and not await self._answers(member):
                log.info("%s worker %s drained and stopped", member.role, address)
                del self.stopping[address]

    def _failed(self, start: Start, why: str) -> None:
        _end(start.pid)   # it never served: nothing to drain
        self.failures += 1
        backoff = min(FIRST_BACKOFF_S * 2 ** (self.failures - 1), MAX_BACKOFF_S)
        self.next_start_at = time.time() + backoff
        log.warning("%s worker on %s %s (log %s); next start in %.0f s", start.member.role, start.member.address,
                    why, start.log_path, backoff)

    async def _answers(self, member: Member) -> bool:
        try:
            await self.client.get(f"{member.url}/health")
            return True
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        await self.client.aclose()
        if self.flipper is not None:
            await self.flipper.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether a worker this connector started still runs (reaping it once it exited)."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)   # reaps our own child once it exited
        if waited == pid:
            return False
    except ChildProcessError:   # not our child (started by a planner before this one)
        pass
    return pid_alive(pid)


def _end(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError, PermissionError):
        pass
