"""KV-aware choice of a worker: the prompt's cached overlap on each one weighed against its load. Pure."""
from __future__ import annotations

from itertools import islice
from typing import Sequence

# Prompt tokens one prefill leg in flight on a worker counts as. Small: a prompt whose prefix a worker holds
# costs its whole prefix again elsewhere, so only a clear imbalance should move it (256 moved chats' turns
# away from their cache under load and computed a fifth more tokens: benchmarks/results/kv_routing.json).
DEFAULT_LEG_TOKENS = 64
# A decode leg holds its worker's batch for its whole answer and a cached prefix only saves it a pull: its
# legs weigh this many times more (2,048 tokens a leg: decode workers are balanced by their legs, and the
# overlap only breaks ties).
DECODE_LEG_FACTOR = 32


def kv_costs(prompt_tokens: int, cached: Sequence[int], legs: Sequence[int],
             leg_tokens: int = DEFAULT_LEG_TOKENS, queued: Sequence[int] | None = None) -> list[int]:
    """Per worker: the prompt tokens it would compute (those it has not cached), plus `leg_tokens` for each
    leg it already has in flight, plus `queued[i]`: the prompt tokens it has yet to compute for those legs
    (the work queued ahead of this one; none when not given)."""
    ahead = [0] * len(legs) if queued is None else queued
    if not len(cached) == len(legs) == len(ahead):
        raise ValueError(f"{len(cached)} overlaps for {len(legs)} loads and {len(ahead)} queues")
    return [max(prompt_tokens - c, 0) + leg_tokens * n + q for c, n, q in zip(cached, legs, ahead)]


def choose(prompt_tokens: int, cached: Sequence[int], legs: Sequence[int], turn: int = 0,
           leg_tokens: int = DEFAULT_LEG_TOKENS, queued: Sequence[int] | None = None) -> int:
    """The index of the worker of least cost (kv_costs); ties go round-robin from `turn`, so equal workers
    share the load. `cached`, `legs` (and `queued`) are per worker, in the same order, and not empty."""
    if not legs:
        raise ValueError("no workers to choose from")
    costs = kv_costs(prompt_tokens, cached, legs, leg_tokens, queued)
    n = len(costs)
    return min(range(n), key=lambda i: (costs[i], (i - turn) % n))


def queued_tokens(recent: Sequence[int], legs: int) -> int:
    """The prompt tokens a worker has yet to compute: those of its `legs` in flight, which are the latest of
    the legs sent to it (`recent`, oldest first: the tokens each one had uncached there), as a worker
    serves its legs in the order they came."""
    return sum(islice(reversed(recent), max(legs, 0)))
