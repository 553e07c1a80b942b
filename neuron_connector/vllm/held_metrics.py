"""The KV blocks a prefill `vllm serve` holds for decode peers' pulls, on vLLM's own `/metrics`.

By vLLM's KV connector stats hooks: the scheduler side (where vLLM keeps the blocks of a finished request
until the connector reports them sent) reports a snapshot, `HeldBlocksStats`, with each step's scheduler
stats while blocks are held and once more when none are left; vLLM's Prometheus stat logger hands it to
`HeldBlocksPromMetrics`, which sets the gauges our worker exports too (common/held_blocks.py), labelled
with vLLM's `model_name` and `engine`. An engine that holds blocks keeps stepping (vLLM waits for their
release), so the oldest set's age stays current until it is released.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from common.held_blocks import ABORT_TIMEOUT, BLOCKS_HELD, HELD_OLDEST

BLOCKS, OLDEST = "kv_blocks_held", "kv_held_oldest_seconds"   # the keys of a snapshot


class HeldBlocksStats(KVConnectorStats):
    """One snapshot of the blocks held (`BLOCKS`) and the oldest set's age (`OLDEST`); the later one wins."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return HeldBlocksStats({**self.data, **other.data})

    def reduce(self) -> dict[str, int | float]:
        return {BLOCKS: int(self.data.get(BLOCKS, 0)), OLDEST: round(float(self.data.get(OLDEST, 0.0)), 3)}

    def is_empty(self) -> bool:
        return not self.data


class HeldBlocksReport:
    """When the scheduler side reports: every step while blocks are held, then once at none (the gauge's 0)."""

    def __init__(self) -> None:
        self._last_blocks: int | None = None

    def take(self, blocks: int, oldest_s: float) -> HeldBlocksStats | None:
        if blocks == 0 and self._last_blocks == 0:
            return None
        self._last_blocks = blocks
        return HeldBlocksStats({BLOCKS: blocks, OLDEST: oldest_s})


class HeldBlocksPromMetrics(KVConnectorPromMetrics):
    """The three held-blocks gauges per engine; the abort timeout is the connector's, set once."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], abort_timeout: float) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._gauges = {key: create_metric_per_engine(
            self._gauge_cls(name=name, documentation=doc, multiprocess_mode="mostrecent", labelnames=labelnames),
            per_engine_labelvalues) for key, (name, doc) in ((BLOCKS, BLOCKS_HELD), (OLDEST, HELD_OLDEST),
                                                             ("abort", ABORT_TIMEOUT))}
        for engine in per_engine_labelvalues:
            self._gauges["abort"][engine].set(abort_timeout)
            self._gauges[BLOCKS][engine].set(0)
            self._gauges[OLDEST][engine].set(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key in (BLOCKS, OLDEST):
            if key in transfer_stats_data:
                self._gauges[key][engine_idx].set(transfer_stats_data[key])
