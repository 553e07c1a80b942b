"""A worker's load as its GET /metrics shows it: KV blocks used and in the pool, requests running, waiting and
held for a transfer; read from our worker's series or `vllm serve`'s."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Our worker's series (worker/server/metrics.py) and vLLM's, by the field they fill.
_SERIES = {
    "kv_blocks_used": ("neuron_di_kv_blocks_used",),
    "kv_blocks_total": ("neuron_di_kv_blocks_total",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("neuron_di_requests_running", "vllm:num_requests_running"),
    "waiting": ("neuron_di_requests_waiting", "vllm:num_requests_waiting"),
    "transferring": ("neuron_di_requests_transferring",),
    "kv_held_oldest_seconds": ("neuron_di_kv_held_oldest_seconds",),
}
_WANTED = {name: field for field, names in _SERIES.items() for name in names}


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker's metrics say; None where its server exports no such series."""

    kv_usage: float | None = None          # share of its KV pool in use, 0..1
    kv_blocks_used: float | None = None
    kv_blocks_total: float | None = None
    running: float | None = None
    waiting: float | None = None
    transferring: float | None = None      # prefill: answered, blocks held for decode's pull; decode: pulling
    kv_held_oldest_seconds: float | None = None  # prefill: how long the oldest blocks held for a pull wait

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def parse_load(text: str) -> WorkerLoad:
    """The load in a Prometheus text page (the sum of each series over its labels); ValueError if it is not one."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        field = _WANTED.get(family.name)
        if field is None:
            continue
        values = [sample.value for sample in family.samples if sample.name == family.name]
        if values and field not in found:
            found[field] = float(sum(values))
    used, total = found.get("kv_blocks_used"), found.get("kv_blocks_total")
    if "kv_usage" not in found and used is not None and total:
        found["kv_usage"] = round(used / total, 4)
    return WorkerLoad(**found)
