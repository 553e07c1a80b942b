"""The workers that run: their records in etcd, and the members a connector is still changing."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import aetcd

from common.errors import RegistrationError
from common.roles import DISAGGREGATED_ROLES
from common.worker_record import KEY_PREFIX, WorkerRecord
from planner.errors import PlannerError
from planner.figures import Counts

log = logging.getLogger("planner.fleet")
STATES = ("serving", "starting", "flipping", "stopping")


@dataclass(frozen=True, slots=True)
class Member:
    """One worker as the planner counts it: `role` is the one it serves, or will serve once `state` is over."""

    address: str         # host:port of its HTTP API
    role: str
    state: str = "serving"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass(frozen=True, slots=True)
class Fleet:
    members: tuple[Member, ...]

    def counts(self) -> Counts:
        """Workers per role, counting changes under way as done (a worker stopping counts no more)."""
        return self._per_role(lambda m: m.state != "stopping")

    def arriving(self) -> Counts:
        """Workers per role still on their way to it (flipping or starting)."""
        return self._per_role(lambda m: m.state in ("flipping", "starting"))

    def _per_role(self, counted: Callable[[Member], bool]) -> Counts:
        members = [m for m in self.members if counted(m)]
        return Counts(sum(m.role == "prefill" for m in members), sum(m.role == "decode" for m in members))

    def serving(self, role: str | None = None) -> list[Member]:
        return [m for m in self.members if m.state == "serving" and role in (None, m.role)]

    @property
    def changing(self) -> list[Member]:
        return [m for m in self.members if m.state != "serving"]


def merge(registered: Iterable[WorkerRecord], changing: Iterable[Member]) -> Fleet:
    """The registered prefill and decode workers, overridden by the members a connector is changing."""
    members = {r.address: Member(r.address, r.role) for r in registered if r.role in DISAGGREGATED_ROLES}
    members.update({m.address: m for m in changing})
    return Fleet(tuple(sorted(members.values(), key=lambda m: m.address)))


class EtcdWorkers:
    """Reads the worker records under `/workers/` from etcd at host:port."""

    def __init__(self, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise PlannerError(f"--etcd must be host:port, got {endpoint!r}")
        self.host, self.port = host, int(port)

    async def read(self) -> list[WorkerRecord]:
        """The well-formed records (a malformed one is logged and skipped); PlannerError if etcd fails."""
        try:
            async with aetcd.Client(self.host, self.port, timeout=3) as client:
                snapshot = await client.get_prefix(KEY_PREFIX.encode())
        except Exception as exc:  # noqa: BLE001 - grpc/etcd errors of every kind
            raise PlannerError(f"etcd {self.host}:{self.port} did not answer: {exc}") from exc
        records = []
        for kv in snapshot:
            try:
                records.append(WorkerRecord.from_json(kv.value))
            except RegistrationError as exc:
                log.warning("ignoring %s in etcd: %s", kv.key.decode(errors="replace"), exc)
        return records
