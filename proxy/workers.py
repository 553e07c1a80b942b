"""Typed worker records, the pool of known workers, and the pure pick (round-robin, or least loaded)."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Callable, Iterable, Sequence

from common.kv_secret import NO_SECRET_ID
from common.roles import DEFAULT_KV_PORT, WORKER_ROLES
from common.errors import RegistrationError
from common.worker_record import KV_PROTOCOLS, VLLM_SERVER, WorkerRecord
from proxy.errors import ConfigError, NoWorkers
from proxy.kv_choice import choose

__all__ = ["KV_PROTOCOLS", "VLLM_SERVER", "WorkerPool", "WorkerRecord", "completed", "contradiction",
           "kv_secret_mismatches", "pick", "shows_draining", "shown_record", "static_worker"]
_WILDCARD_HOSTS = ("0.0.0.0", "::")  # a signal plane bound to every address: reach it at the worker's HTTP host


def static_worker(role: str, host: str, http_port: int, kv_port: int = DEFAULT_KV_PORT,
                  kv_protocol: str = "neuron", status_port: int = 0) -> WorkerRecord:
    """A worker given on the command line; ConfigError for a bad role, address or protocol."""
    try:
        return WorkerRecord(role, host, http_port, kv_port=kv_port, kv_protocol=kv_protocol, status_port=status_port)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def shown_record(health: bytes) -> WorkerRecord | None:
    """The record a worker shows under `worker` in its GET /health answer; None if it shows none
    (vLLM's `vllm serve` answers with an empty body)."""
    try:
        return WorkerRecord.from_dict(json.loads(health)["worker"])
    except (ValueError, TypeError, KeyError, RegistrationError):
        return None


def shows_draining(health: bytes) -> bool:
    """Whether a worker's GET /health answer says it drains (it takes no new request)."""
    try:
        return json.loads(health).get("draining") is True
    except (ValueError, AttributeError):
        return False


def contradiction(given: WorkerRecord, shown: WorkerRecord, kv_port_given: bool) -> str | None:
    """How the record a static worker shows contradicts the one the command line gives (`given`,
    whose KV port counts only if `kv_port_given`), or None if it does not."""
    where = f"{given.role} worker {given.address}"
    if shown.role != given.role:
        return f"{where}: the worker there is a {shown.role} worker"
    if shown.kv_protocol != given.kv_protocol:
        return f"{where}: driven with kv_protocol {given.kv_protocol!r}, but the worker speaks {shown.kv_protocol!r}"
    if kv_port_given and shown.kv_port != given.kv_port:
        return (f"{where}: the command line gives KV port {given.kv_port}, but the worker's signal plane "
                f"listens on port {shown.kv_port}")
    return None


def completed(given: WorkerRecord, shown: WorkerRecord) -> WorkerRecord:
    """A static worker as the proxy reaches it (`given`), with the signal plane, engine id and model it shows:
    decode legs then name its real KV port and carry its engine id, which the decode side checks."""
    kv_host = given.kv_host if shown.kv_host in _WILDCARD_HOSTS else shown.kv_host
    return replace(given, kv_host=kv_host, kv_port=shown.kv_port, engine_id=shown.engine_id, model=shown.model,
                   transfer=shown.transfer, kv_secret_id=shown.kv_secret_id, kv_events=shown.kv_events or given.kv_events,
                   server=shown.server, status_port=shown.status_port)


def kv_secret_mismatches(prefills: Iterable[WorkerRecord], decodes: Iterable[WorkerRecord]) -> list[str]:
    """The pairs of (neuron) prefill and decode workers whose records show they cannot authenticate to each
    other on the KV plane, in words; workers whose record does not say (vLLM's static ones) are not judged."""
    decodes = [d for d in decodes if d.kv_protocol == "neuron" and d.kv_secret_id]
    found = []
    for p in (p for p in prefills if p.kv_protocol == "neuron" and p.kv_secret_id):
        for d in (d for d in decodes if d.kv_secret_id != p.kv_secret_id):
            why = ("the prefill worker requires a KV secret and the decode worker has none"
                   if d.kv_secret_id == NO_SECRET_ID else
                   "the decode worker has a KV secret and the prefill worker has none"
                   if p.kv_secret_id == NO_SECRET_ID else "their KV secrets differ")
            found.append(f"decode worker {d.address} cannot authenticate to prefill worker {p.address}: {why} "
                         "(give every worker the same --kv-secret-file)")
    return found


def pick(candidates: Sequence[WorkerRecord], turn: int, legs: Sequence[int] | None = None) -> WorkerRecord:
    """Round-robin: the `turn`-th candidate, cycling; given each one's `legs` in flight, the one with the fewest,
    in turn among equals. Candidates must be non-empty."""
    if legs is None:
        return candidates[turn % len(candidates)]
    return candidates[choose(0, [0] * len(candidates), legs, turn, leg_tokens=1)]


class WorkerPool:
    """The workers the proxy knows, which of them are healthy, and a turn counter per role and protocol; given
    `legs(worker)` (its legs in flight), `next` picks the least loaded, in turn among equals.

    Plain synchronous state, touched only from the event loop: discovery and health
    checks update it, request handlers read it. `on_lost(worker, why)` is called when a worker
    leaves the pool or is found gone (`lose`), so its legs in flight can end. A worker that
    `retire`s (its etcd record went: it drains, or died) is out of rotation at once, but its legs
    run on until the health checks find it gone.
    """

    def __init__(self, workers: Iterable[WorkerRecord] = (),
                 on_lost: Callable[[WorkerRecord, str], None] | None = None,
                 legs: Callable[[WorkerRecord], int] | None = None) -> None:
        self._on_lost = on_lost
        self._legs = legs
        self._workers: dict[str, WorkerRecord] = {}
        self._down: set[str] = set()
        self._why: dict[str, str] = {}  # why a worker is out of rotation, in a sentence naming it
        self._retired: set[str] = set()
        self._turns: dict[tuple[str, str | None], int] = {}
        self._healthy: dict[str, list[WorkerRecord]] | None = None
        for worker in workers:
            self.add(worker)

    def add(self, worker: WorkerRecord) -> None:
        self._workers[worker.key] = worker
        self._down.discard(worker.key)
        self._why.pop(worker.key, None)
        self._retired.discard(worker.key)
        self._healthy = None

    def remove(self, key: str, why: str = "left the pool", end_legs: bool = True) -> None:
        """Out of the pool; its legs in flight end too unless `end_legs` is False."""
        worker = self._workers.pop(key, None)
        self._down.discard(key)
        self._why.pop(key, None)
        self._retired.discard(key)
        self._healthy = None
        if worker is not None and end_legs:
            self._lost(worker, why)

    def replace_all(self, workers: Iterable[WorkerRecord], why: str = "left the pool") -> None:
        fresh = {w.key: w for w in workers}
        gone = [w for key, w in self._workers.items() if key not in fresh]
        self._down &= fresh.keys()
        self._why = {key: why for key, why in self._why.items() if key in fresh}
        self._retired &= fresh.keys()
        self._workers = fresh
        self._healthy = None
        for worker in gone:
            self._lost(worker, why)

    def retire(self, key: str) -> None:
        """Out of rotation for good, its legs left running: `retired` until it is removed (or added anew)."""
        if key in self._workers:
            worker = self._workers[key]
            self.mark(key, healthy=False, why=f"{worker.role} worker {worker.address}: its etcd record is gone")
            self._retired.add(key)

    def retired(self, key: str) -> bool:
        return key in self._retired

    def mark(self, key: str, healthy: bool, why: str = "") -> bool:
        """Puts a worker in or out of rotation (a retired one stays out), out of it because of `why`; True if
        that changed anything."""
        if healthy:
            self._why.pop(key, None)
        elif why and key in self._workers:
            self._why[key] = why
        if key not in self._workers or (key not in self._down) == healthy or key in self._retired:
            return False
        if healthy:
            self._down.discard(key)
        else:
            self._down.add(key)
        self._healthy = None
        return True

    def lose(self, key: str, why: str) -> None:
        """The worker is known but gone (`why`): its legs in flight end; it stays known, out of rotation."""
        worker = self._workers.get(key)
        if worker is not None:
            self.mark(key, healthy=False, why=f"{worker.role} worker {worker.address}: {why}")
            self._lost(worker, why)

    def _lost(self, worker: WorkerRecord, why: str) -> None:
        if self._on_lost is not None:
            self._on_lost(worker, why)

    def all(self) -> list[WorkerRecord]:
        return sorted(self._workers.values(), key=lambda w: w.key)

    def reasons(self, roles: Iterable[str]) -> tuple[str, ...]:
        """Why each known worker of `roles` that is out of rotation is out, sorted by key."""
        roles = set(roles)
        return tuple(self._why.get(w.key) or f"{w.role} worker {w.address}: out of rotation"
                     for w in self.all() if w.role in roles and w.key in self._down)

    def listed(self, role: str) -> list[WorkerRecord]:
        """The workers of `role` still listed (healthy or not; a retired one is not), sorted by key."""
        return [w for w in self.all() if w.role == role and w.key not in self._retired]

    def healthy(self, role: str, kv_protocol: str | None = None) -> list[WorkerRecord]:
        """The healthy workers of `role` (and of `kv_protocol`, if given), sorted by key."""
        if self._healthy is None:
            # Sorted so that the rotation order does not depend on discovery order.
            self._healthy = {r: [] for r in WORKER_ROLES}
            for worker in self.all():
                if worker.key not in self._down:
                    self._healthy[worker.role].append(worker)
        workers = self._healthy[role]
        return workers if kv_protocol is None else [w for w in workers if w.kv_protocol == kv_protocol]

    def next(self, role: str, kv_protocol: str | None = None) -> WorkerRecord:
        """Picks the next healthy worker of `role` (driven by `kv_protocol`, if given); NoWorkers at once if none."""
        candidates = self.healthy(role, kv_protocol)
        if not candidates:
            raise NoWorkers(role, kv_protocol, self.reasons([role]))
        turn = self._turns.get((role, kv_protocol), 0)
        self._turns[(role, kv_protocol)] = turn + 1
        return pick(candidates, turn, [self._legs(w) for w in candidates] if self._legs else None)
