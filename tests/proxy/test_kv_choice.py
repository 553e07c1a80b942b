"""KV-aware routing's choice of a worker (proxy/kv_choice.py), with plain lists, and the router's use of it."""
from __future__ import annotations

import asyncio
import json

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from common.kv_events import BlockStored, EventBatch
from common.tokenizer import Tokenizer
from common.worker_record import OUR_SERVER, WorkerRecord
from proxy import COMPLETIONS, parse_request
from proxy.kv_choice import choose, kv_costs, queued_tokens
from proxy.kv_index import KVIndexes
from proxy.kv_route import KVRouter, KVRoutingConfig
from proxy.prompt_tokens import encoding_of, prompt_token_ids
from proxy.workers import WorkerPool

WORKERS = st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 64), st.integers(0, 20000)), min_size=1, max_size=8)


@given(st.integers(0, 4096), st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 64)), min_size=1, max_size=8),
       st.integers(0, 100))
def test_choice_is_a_least_cost_worker(prompt: int, workers: list[tuple[int, int]], turn: int) -> None:
    cached, legs = [c for c, _ in workers], [n for _, n in workers]
    i = choose(prompt, cached, legs, turn)
    costs = kv_costs(prompt, cached, legs)
    assert costs[i] == min(costs)
    idle = [j for j, n in enumerate(legs) if n == 0]
    if idle and all(c == cached[0] for c in cached):
        assert legs[i] == 0            # equal caches: an idle worker wins


@given(st.integers(1, 8), st.integers(0, 50))
def test_equal_workers_are_taken_in_turn(n: int, turn: int) -> None:
    assert [choose(100, [0] * n, [0] * n, turn + k) for k in range(n)] == [(turn + k) % n for k in range(n)]


def test_more_cache_beats_less_until_the_load_outweighs_it() -> None:
    assert choose(1000, [960, 0], [0, 0]) == 0
    assert choose(1000, [960, 0], [3, 0], leg_tokens=256) == 0
    assert choose(1000, [960, 0], [4, 0], leg_tokens=256) == 1


@given(st.integers(0, 4096), WORKERS, st.integers(0, 100), st.integers(0, 512))
def test_choice_with_queued_tokens_is_a_least_cost_worker(prompt: int, workers: list[tuple[int, int, int]],
                                                          turn: int, leg_tokens: int) -> None:
    cached, legs, queued = ([w[k] for w in workers] for k in range(3))
    i = choose(prompt, cached, legs, turn, leg_tokens, queued)
    costs = kv_costs(prompt, cached, legs, leg_tokens, queued)
    assert costs[i] == min(costs)
    assert costs == [max(prompt - c, 0) + leg_tokens * n + q for c, n, q in zip(cached, legs, queued)]
    assert kv_costs(prompt, cached, legs, leg_tokens, [0] * len(legs)) == kv_costs(prompt, cached, legs, leg_tokens)
    if len(set(cached)) == 1 and len(set(legs)) == 1:
        assert queued[i] == min(queued)   # same cache, same legs: the shortest queue wins


def test_a_long_queue_outweighs_a_cached_prompt() -> None:
    """The worker holding 960 of 1,000 tokens computes 40; it loses once more than 960 tokens more wait there."""
    assert choose(1000, [960, 0], [1, 1], leg_tokens=0, queued=[900, 0]) == 0
    assert choose(1000, [960, 0], [1, 1], leg_tokens=0, queued=[961, 0]) == 1
    assert choose(1000, [960, 0], [1, 1], leg_tokens=0, queued=[1900, 1000]) == 0


@given(st.lists(st.integers(0, 4096), max_size=40), st.integers(-2, 60))
def test_queued_tokens_are_those_of_the_latest_legs(recent: list[int], legs: int) -> None:
    expected = sum(recent[len(recent) - legs:]) if 0 < legs <= len(recent) else sum(recent) if legs > 0 else 0
    assert queued_tokens(recent, legs) == expected


def test_router_counts_the_tokens_queued_on_a_prefill_worker() -> None:
    """Of two prefill workers holding half a prompt, one holds a block more: the router sends the prompt there,
    which then has a leg in flight with the other half queued. With queued tokens on, the next equal prompt
    goes to the other worker even at no weight per leg; without, both go to the first."""
    tokenizer, text = Tokenizer.builtin(), "a prompt two prefill workers both hold " * 4
    request = parse_request(COMPLETIONS, json.dumps({"model": "m", "prompt": text}).encode(), True)
    first, second = WorkerRecord("prefill", "h", 1, server=OUR_SERVER), WorkerRecord("prefill", "h", 2,
                                                                                    server=OUR_SERVER)
    ids = prompt_token_ids(request, tokenizer, encoding_of(first))
    half = len(ids) // 8 * 4
    picked = {}
    for queued in (False, True):
        indexes = KVIndexes()
        for worker, n in ((first, half), (second, half - 4)):
            indexes.index(worker.key).apply(EventBatch(0, 0, (BlockStored(tuple(range(n // 4)), None,
                                                                          tuple(ids[:n]), 4),)))
        pool = WorkerPool([first, second, WorkerRecord("decode", "h", 3)])
        legs = {first.key: 0, second.key: 0}
        router = KVRouter(KVRoutingConfig(tokenizer, leg_tokens=0, queued=queued), pool, indexes,
                          lambda w: legs.get(w.key, 0), CollectorRegistry())
        picks = []
        for _ in range(2):
            picks.append(asyncio.run(router.picks(request)).prefill)
            legs[picks[-1].key] += 1
        picked[queued] = picks
    assert picked[False] == [first, first]
    assert picked[True] == [first, second]


def test_queued_tokens_count_by_default_and_can_be_turned_off() -> None:
    from proxy import parse_args
    base = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--routing", "kv", "--tokenizer", "builtin"]
    assert parse_args(base).kv_routing.queued
    assert not parse_args([*base, "--no-kv-load-queued-tokens"]).kv_routing.queued
