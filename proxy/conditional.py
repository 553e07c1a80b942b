"""Conditional disaggregation: is a request's prompt prefilled by a prefill worker, or by its decode worker?

As in Dynamo's disaggregated router: the prompt goes to a prefill worker (the "remote" path: two legs,
the KV moved to the decode worker) only when the part of it the decode worker's prefix cache does not
hold is longer than `max_local_prefill_tokens`, and the prefill side is not busy (fewer than
`max_prefill_queue` prefill legs in flight per prefill worker). Otherwise the decode worker serves the
request whole (the "local" path, one leg): a short prefill costs it less than a KV transfer, and with
chunked prefill its running streams are not stalled by it. Pure: plain numbers in, a path out.

The defaults come from the mixed workload of benchmarks/bench_serving.py --compare-conditional
(docs/benchmarks.md says why these values).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

LOCAL, REMOTE = "local", "remote"
PATHS = (LOCAL, REMOTE)
DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 128
DEFAULT_MAX_PREFILL_QUEUE = 2


@dataclass(frozen=True, slots=True)
class ConditionalPolicy:
    """The two thresholds of conditional disaggregation (see the module docstring)."""

    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS
    max_prefill_queue: int = DEFAULT_MAX_PREFILL_QUEUE

    def __post_init__(self) -> None:
        if self.max_local_prefill_tokens < 0:
            raise ValueError(f"max_local_prefill_tokens must be at least 0, got {self.max_local_prefill_tokens}")
        if self.max_prefill_queue < 1:
            raise ValueError(f"max_prefill_queue must be at least 1, got {self.max_prefill_queue}")

    def path(self, prompt_tokens: int, cached_tokens: int, prefill_queue: float) -> str:
        """REMOTE if the uncached prompt is longer than the threshold and the prefill queue shorter; else LOCAL."""
        uncached = prompt_tokens - min(cached_tokens, prompt_tokens)
        if uncached > self.max_local_prefill_tokens and prefill_queue < self.max_prefill_queue:
            return REMOTE
        return LOCAL


def prefill_queue(legs_in_flight: Sequence[int]) -> float:
    """The prefill side's queue: prefill legs in flight per healthy prefill worker (inf with none, so that
    requests stay with their decode workers)."""
    return sum(legs_in_flight) / len(legs_in_flight) if legs_in_flight else math.inf
