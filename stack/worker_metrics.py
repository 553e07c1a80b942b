"""What a running process's Prometheus `/metrics` says: a series summed over its labels, the KV
blocks in use, and a wait until every worker of a stack holds no block."""
from __future__ import annotations

import re
import time
from typing import Mapping

import httpx

_SAMPLE = re.compile(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$")


def metric(url: str, name: str, default: float | None = None, timeout_s: float = 10.0, **labels: str) -> float:
    """The sum of the samples of `name` on `url`/metrics whose labels include every `labels` item (others are
    ignored); `default` when there is none, or, without a default, a LookupError naming the series."""
    text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    values = [float(match.group(3)) for line in text.splitlines()
              if (match := _SAMPLE.match(line)) and match.group(1) == name
              and all(label in (match.group(2) or "") for label in wanted)]
    if values:
        return sum(values)
    if default is None:
        raise LookupError(f"series {name} {labels or ''} not on {url}/metrics")
    return default


def metric_sum(url: str, name: str, timeout_s: float = 10.0) -> int:
    """The sum of the worker's samples of the metric `name` over all their labels (0 if it has none)."""
    return int(metric(url, name, default=0.0, timeout_s=timeout_s))


def blocks_used(url: str) -> int:
    """The worker's neuron_di_kv_blocks_used gauge, summed over its labels."""
    return metric_sum(url, "neuron_di_kv_blocks_used")


def wait_blocks_free(worker_urls: Mapping[str, str], timeout_s: float) -> dict[str, int]:
    """Blocks in use per worker (name -> URL), polled until all are 0 or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {name: blocks_used(url) for name, url in worker_urls.items()}
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.05)
