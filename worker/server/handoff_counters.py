"""Counters of the KV handoff's safety nets, read from the worker's signal plane at each scrape.

- fenced handoffs (decode): pulls whose destination blocks a handoff fence guarded (transfer.fences), so that
  no write of another handoff could land in them;
- stale writes refused (prefill): pushes refused because the decode peer no longer held their blocks for their
  handoff (it had given up on the pull, and may have reused the blocks);
- stale incarnations: on a prefill worker, lookups refused because they were addressed to another life of it,
  or came from a decode engine's new life for a request held for its old one; on a decode worker, pulls failed
  because another incarnation of their prefill peer answered at its address (neuron_connector.incarnation).

Every series is exported by every worker (0 where the role does not count it), so that a rate always exists.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.engine.kv_connector import KVConnector

FENCED = "neuron_di_kv_fenced_handoffs"
STALE_WRITES = "neuron_di_kv_stale_writes_refused"
STALE_INCARNATIONS = "neuron_di_kv_stale_incarnations"


class HandoffCounters(Collector):
    """The counters above, read from `connector` at each collect (none: all 0)."""

    def __init__(self, model_name: str, connector: KVConnector | None) -> None:
        self._model, self._connector = model_name, connector

    def collect(self) -> Iterator[Metric]:
        send = self._connector.send if self._connector is not None else None
        recv = self._connector.recv if self._connector is not None else None
        fenced, other_life = recv.fence_counts if recv is not None else (0, 0)
        for name, doc, value in (
                (FENCED, "Decode: KV pulls whose blocks a handoff fence guarded", fenced),
                (STALE_WRITES, "Prefill: KV pushes refused because the decode peer no longer held their blocks "
                 "for their handoff", send.stats.stale_pushes if send is not None else 0),
                (STALE_INCARNATIONS, "KV lookups (prefill) or pulls (decode) refused or failed because another "
                 "incarnation of the peer (a process restarted with its engine id) was involved",
                 other_life + (send.stats.stale_lookups if send is not None else 0))):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], float(value))
            yield family
