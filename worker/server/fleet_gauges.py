"""What an operator's alerts read from a worker besides its engine's series: blocks held for a decode peer's pull
(how many, the oldest set's age, and the abort timeout that should have freed it), whether it drains, and the
global prefill queue's jobs it holds unacked (redelivered to another worker if it dies); its page also carries the
handoff counters (worker/server/handoff_counters.py)."""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.held_blocks import ABORT_TIMEOUT, BLOCKS_HELD, HELD_OLDEST
from worker.engine.kv_connector import KVConnector
from worker.server.handoff_counters import HandoffCounters


JOBS_HELD = ("neuron_di_prefill_jobs_held", "Prefill: jobs taken from the global prefill queue and not yet acked")


class _FleetGauges(Collector):
    def __init__(self, model_name: str, connector: KVConnector | None, draining: bool, jobs_held: int | None) -> None:
        self._model, self._connector, self._draining, self._jobs_held = model_name, connector, draining, jobs_held

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        draining = GaugeMetricFamily("neuron_di_draining", "1 while the worker drains (takes no new request)",
                                     labels=labels)
        draining.add_metric([self._model], float(self._draining))
        yield draining
        if self._jobs_held is not None:
            jobs = GaugeMetricFamily(*JOBS_HELD, labels=labels)
            jobs.add_metric([self._model], float(self._jobs_held))
            yield jobs
        if self._connector is None or self._connector.role != "prefill":
            return
        blocks, oldest = self._connector.held.snapshot()
        for (name, doc), value in ((BLOCKS_HELD, blocks), (HELD_OLDEST, oldest),
                                   (ABORT_TIMEOUT, self._connector.config.abort_timeout)):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self._model], float(value))
            yield family


def fleet_gauges_page(model_name: str, connector: KVConnector | None, draining: bool,
                      jobs_held: int | None) -> bytes:
    """The gauges above and the handoff counters as Prometheus text, read now; `jobs_held` None: no queue puller."""
    registry = CollectorRegistry()
    registry.register(_FleetGauges(model_name, connector, draining, jobs_held))
    registry.register(HandoffCounters(model_name, connector))
    return generate_latest(registry)
