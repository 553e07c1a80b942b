"""Typed worker records, the pool of known workers, and the pure round-robin pick."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from proxy.errors import ConfigError, NoWorkers

ROLES = ("prefill", "decode", "both")
DEFAULT_KV_PORT = 14579


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One worker as registered in etcd under `/workers/{role}/{host}/{http_port}`."""

    role: str
    host: str
    http_port: int
    kv_host: str = ""
    kv_port: int = DEFAULT_KV_PORT
    engine_id: str = ""
    model: str = ""
    transfer: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"worker role must be one of {ROLES}, got {self.role!r}")
        if not self.host or not 0 < self.http_port < 65536:
            raise ConfigError(f"bad worker address {self.host!r}:{self.http_port}")
        # Static workers have no registry record: their peer info follows from the address.
        if not self.kv_host:
            object.__setattr__(self, "kv_host", self.host)
        if not self.engine_id:
            object.__setattr__(self, "engine_id", f"{self.host}:{self.http_port}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def key(self) -> str:
        return f"/workers/{self.role}/{self.host}/{self.http_port}"

    def to_json(self) -> bytes:
        return json.dumps({
            "role": self.role, "host": self.host, "http_port": self.http_port,
            "kv_host": self.kv_host, "kv_port": self.kv_port, "engine_id": self.engine_id,
            "transfer": self.transfer, "model": self.model,
        }).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerRecord:
        try:
            data = json.loads(raw)
            return cls(role=data["role"], host=data["host"], http_port=int(data["http_port"]),
                       kv_host=data.get("kv_host") or "", kv_port=int(data.get("kv_port", DEFAULT_KV_PORT)),
                       engine_id=data.get("engine_id") or "", model=data.get("model") or "",
                       transfer=dict(data.get("transfer") or {}))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(f"bad worker record {raw!r}: {exc}") from exc


def pick(candidates: Sequence[WorkerRecord], turn: int) -> WorkerRecord:
    """Round-robin: the `turn`-th candidate, cycling. Candidates must be non-empty."""
    return candidates[turn % len(candidates)]


class WorkerPool:
    """The workers the proxy knows, which of them are healthy, and a turn counter per role.

    Plain synchronous state, touched only from the event loop: discovery and health
    checks update it, request handlers read it.
    """

    def __init__(self, workers: Iterable[WorkerRecord] = ()) -> None:
        self._workers: dict[str, WorkerRecord] = {}
        self._down: set[str] = set()
        self._turns = {role: 0 for role in ROLES}
        self._healthy: dict[str, list[WorkerRecord]] | None = None
        for worker in workers:
            self.add(worker)

    def add(self, worker: WorkerRecord) -> None:
        self._workers[worker.key] = worker
        self._down.discard(worker.key)
        self._healthy = None

    def remove(self, key: str) -> None:
        self._workers.pop(key, None)
        self._down.discard(key)
        self._healthy = None

    def replace_all(self, workers: Iterable[WorkerRecord]) -> None:
        fresh = {w.key: w for w in workers}
        self._down &= fresh.keys()
        self._workers = fresh
        self._healthy = None

    def mark(self, key: str, healthy: bool) -> bool:
        """Puts a worker in or out of rotation; True if that changed anything."""
        if key not in self._workers or (key not in self._down) == healthy:
            return False
        if healthy:
            self._down.discard(key)
        else:
            self._down.add(key)
        self._healthy = None
        return True

    def all(self) -> list[WorkerRecord]:
        return sorted(self._workers.values(), key=lambda w: w.key)

    def healthy(self, role: str) -> list[WorkerRecord]:
        if self._healthy is None:
            # Sorted so that the rotation order does not depend on discovery order.
            self._healthy = {r: [] for r in ROLES}
            for worker in self.all():
                if worker.key not in self._down:
                    self._healthy[worker.role].append(worker)
        return self._healthy[role]

    def next(self, role: str) -> WorkerRecord:
        """Picks the next healthy worker of `role`; NoWorkers at once if there is none."""
        candidates = self.healthy(role)
        if not candidates:
            raise NoWorkers(role)
        turn = self._turns[role]
        self._turns[role] = turn + 1
        return pick(candidates, turn)
