"""The worker pool as Prometheus gauges, read when scraped: which workers are healthy or drain, per role."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.workers import WorkerPool


class PoolCollector(Collector):
    """`proxy_worker_healthy{role,worker}` and `proxy_worker_draining{role,worker}` (1 or 0) per known worker,
    and `proxy_healthy_workers{role}` for every role the proxy needs (0 when it has none: what an alert on
    a role with no healthy worker reads) and every other role it knows a worker of."""

    def __init__(self, pool: WorkerPool, needed_roles: Iterable[str], draining: Callable[[], set[str]]) -> None:
        self._pool = pool
        self._needed = tuple(needed_roles)
        self._draining = draining

    def collect(self) -> Iterator[Metric]:
        workers = self._pool.all()
        draining = self._draining()
        healthy_family = GaugeMetricFamily("proxy_worker_healthy", "1 while the worker is in rotation (healthy, "
                                           "not draining), else 0", labels=["role", "worker"])
        draining_family = GaugeMetricFamily("proxy_worker_draining", "1 while the worker says it drains",
                                            labels=["role", "worker"])
        counts = GaugeMetricFamily("proxy_healthy_workers", "Workers of a role in rotation", labels=["role"])
        for worker in workers:
            up = any(w.key == worker.key for w in self._pool.healthy(worker.role))
            healthy_family.add_metric([worker.role, worker.address], float(up))
            draining_family.add_metric([worker.role, worker.address], float(worker.key in draining))
        roles = dict.fromkeys([*self._needed, *(w.role for w in workers)])
        for role in roles:
            counts.add_metric([role], float(len(self._pool.healthy(role))))
        yield healthy_family
        yield draining_family
        yield counts
