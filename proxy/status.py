"""GET /status: the proxy's one-page view of the fleet, for an operator and the launchers' `--status N`.

    {"workers": {"prefill": [{"address": ..., "healthy": true, "draining": false, "why": null,
                              "in_flight": 2, "load": {"kv_usage": 0.12, "running": 1, ...}}, ...],
                 "decode": [...]},
     "prefill_queue_depth": 0,
     "phases": {"decode_first": {"count": 40, "p50": 0.21, "p90": 0.3, "p99": 0.41}, ...},
     "requests": {"200": 40, ...}}

`load` is what the worker's own GET /metrics says (proxy/worker_load.py), read when asked, each worker
at most `timeout` seconds; a worker that does not answer shows `"load": null` and why in `load_error`.
`phases`: percentiles of each request phase (proxy/phase_timeline.py) over the last requests.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry

from proxy.errors import UpstreamError
from proxy.phase_timeline import PhaseTimeline
from proxy.upstream import Upstream
from proxy.worker_load import parse_load
from proxy.workers import WorkerPool, WorkerRecord

LOAD_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class StatusSources:
    """Where GET /status reads from: the proxy's pool, its clients, its legs, its metrics and its timeline."""

    pool: WorkerPool
    clients: Callable[[WorkerRecord], Upstream]
    in_flight: Callable[[WorkerRecord], int]
    draining: Callable[[], set[str]]
    registry: CollectorRegistry
    timeline: PhaseTimeline
    roles: tuple[str, ...]


async def status(sources: StatusSources, timeout: float = LOAD_TIMEOUT_S) -> dict[str, Any]:
    """The GET /status body."""
    workers = sources.pool.all()
    loads = await asyncio.gather(*(_load(sources.clients(w), timeout) for w in workers))
    healthy = {w.key for role in {w.role for w in workers} for w in sources.pool.healthy(role)}
    reasons = dict(zip((w.key for w in workers if w.key not in healthy), sources.pool.reasons({w.role for w in workers})))
    draining = sources.draining()
    by_role: dict[str, list[dict[str, Any]]] = {role: [] for role in sources.roles}
    for worker, (load, error) in zip(workers, loads):
        entry = {"address": worker.address, "healthy": worker.key in healthy, "draining": worker.key in draining,
                 "why": reasons.get(worker.key), "in_flight": sources.in_flight(worker), "load": load}
        if error is not None:
            entry["load_error"] = error
        by_role.setdefault(worker.role, []).append(entry)
    depth = sources.registry.get_sample_value("proxy_prefill_queue_depth") or 0.0
    return {"workers": by_role, "prefill_queue_depth": int(depth), "phases": sources.timeline.percentiles(),
            "requests": _requests(sources.registry)}


async def _load(client: Upstream, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    try:
        reply = await asyncio.wait_for(client.get("/metrics", timeout), timeout)
    except (UpstreamError, asyncio.TimeoutError) as exc:
        return None, str(exc) or f"no answer to GET /metrics within {timeout:g} s"
    if reply.status != 200:
        return None, f"GET /metrics answered HTTP {reply.status}"
    try:
        return parse_load(reply.body.decode(errors="replace")).to_dict(), None
    except ValueError as exc:
        return None, f"GET /metrics is not Prometheus text: {exc}"


def _requests(registry: CollectorRegistry) -> dict[str, int]:
    """Client requests so far by HTTP status, over both endpoints."""
    counts: dict[str, int] = {}
    for family in registry.collect():
        if family.name == "proxy_requests":
            for sample in _totals(family.samples):
                status = sample.labels["status"]
                counts[status] = counts.get(status, 0) + int(sample.value)
    return dict(sorted(counts.items()))


def _totals(samples: Iterable[Any]) -> Iterable[Any]:
    return (s for s in samples if s.name.endswith("_total"))
