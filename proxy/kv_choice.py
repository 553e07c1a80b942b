"""KV-aware choice of a worker: the prompt's cached overlap on each one weighed against its load. Pure."""
from __future__ import annotations

from typing import Sequence

DEFAULT_LEG_TOKENS = 256   # prompt tokens one prefill leg in flight on a worker counts as
# A decode leg holds its worker's batch for its whole answer and a cached prefix only saves it a pull: its
# legs weigh this many times more.
DECODE_LEG_FACTOR = 8


def kv_costs(prompt_tokens: int, cached: Sequence[int], legs: Sequence[int],
             leg_tokens: int = DEFAULT_LEG_TOKENS) -> list[int]:
    """Per worker: the prompt tokens it would compute (those it has not cached) plus `leg_tokens` for each
    leg it already has in flight (the work queued ahead of this one)."""
    if len(cached) != len(legs):
        raise ValueError(f"{len(cached)} overlaps for {len(legs)} loads")
    return [max(prompt_tokens - c, 0) + leg_tokens * n for c, n in zip(cached, legs)]


def choose(prompt_tokens: int, cached: Sequence[int], legs: Sequence[int], turn: int = 0,
           leg_tokens: int = DEFAULT_LEG_TOKENS) -> int:
    """The index of the worker of least cost (kv_costs); ties go round-robin from `turn`, so equal workers
    share the load. `cached` and `legs` are per worker, in the same order, and not empty."""
    if not legs:
        raise ValueError("no workers to choose from")
    costs = kv_costs(prompt_tokens, cached, legs, leg_tokens)
    n = len(costs)
    return min(range(n), key=lambda i: (costs[i], (i - turn) % n))
