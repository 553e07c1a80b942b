"""What a running worker's Prometheus `/metrics` says: a gauge summed over its labels, the KV
blocks in use, and a wait until every worker of a stack holds no block."""
from __future__ import annotations

import re
import time
from typing import Mapping

import httpx


def metric_sum(url: str, name: str, timeout_s: float = 10.0) -> int:
    """The sum of the worker's samples of the metric `name` over all their labels."""
    text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+]+)$"
    return int(sum(float(value) for value in re.findall(pattern, text, re.M)))


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
