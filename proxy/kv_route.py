"""KV-aware routing in the request path (--routing kv): the prefill and the decode worker of a request
picked by the prompt's cached overlap on each (proxy/kv_index.py, fed by proxy/kv_events_follower.py)
against its legs in flight and, on a prefill worker, the prompt tokens they have yet to compute there
(proxy/kv_choice.py).

Counts, per routed request, its prompt tokens, the tokens the picked prefill worker holds and the most
any prefill worker holds: `hit / best` is how much of the reachable prefix reuse routing took.
"""
from __future__ import annotations

import argparse
import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter

from common.tokenizer import Tokenizer
from proxy.errors import ConfigError
from proxy.kv_events_follower import KVEventMetrics, KVEventsFollower
from proxy.kv_choice import DECODE_LEG_FACTOR, DEFAULT_LEG_TOKENS, choose, queued_tokens
from proxy.kv_index import DEFAULT_CAPACITY, KVIndexes
from proxy.prompt_tokens import encoding_of, prompt_ids_by_encoding
from proxy.requests import ClientRequest
from proxy.workers import WorkerPool, WorkerRecord

ROUTINGS = ("round_robin", "least_loaded", "kv")
_RECENT_LEGS = 256   # per prefill worker, the uncached tokens of this many latest legs are kept


@dataclass(frozen=True, slots=True)
class KVRoutingConfig:
    """--routing kv's settings: the tokenizer, events endpoints the command line names, the load weight."""

    tokenizer: Tokenizer = field(compare=False)
    static_endpoints: tuple[tuple[str, str], ...] = ()   # (worker HOST:PORT, tcp://HOST:PORT)
    leg_tokens: int = DEFAULT_LEG_TOKENS
    capacity: int = DEFAULT_CAPACITY
    queued: bool = True   # a prefill worker's load also counts the uncached tokens of its legs in flight


@dataclass(frozen=True, slots=True)
class Picks:
    prefill: WorkerRecord
    decode: WorkerRecord


class KVRouter:
    """Picks both workers of a request from the indexes and the legs in flight (`legs(worker)`)."""

    def __init__(self, config: KVRoutingConfig, pool: WorkerPool, indexes: KVIndexes,
                 legs: Callable[[WorkerRecord], int], registry: CollectorRegistry) -> None:
        self._config = config
        self._pool = pool
        self.indexes = indexes
        self._legs = legs
        self._turns = {"prefill": 0, "decode": 0}
        self._recent: dict[str, deque[int]] = {}   # prefill worker -> uncached tokens of its latest legs
        self.tokens = Counter("proxy_kv_route_tokens", "Prompt tokens of KV-routed requests (prompt), held by the "
                              "picked prefill worker (hit), held by the best one (best)", ["kind"], registry=registry)

    async def picks(self, request: ClientRequest) -> Picks | None:
        """Both workers for `request`; None for a prompt the proxy does not count (round-robin then)."""
        workers = [*self._pool.healthy("prefill"), *self._pool.healthy("decode")]
        if not self._pool.healthy("prefill") or not self._pool.healthy("decode"):
            return None
        ids = await asyncio.to_thread(prompt_ids_by_encoding, request, self._config.tokenizer, workers)
        if ids is None:
            return None
        prefill, cached, prompt_len = self._pick("prefill", ids)
        self.tokens.labels("prompt").inc(prompt_len)
        self.tokens.labels("hit").inc(cached[0])
        self.tokens.labels("best").inc(cached[1])
        decode, _, _ = self._pick("decode", ids, prefill.kv_protocol)
        return Picks(prefill, decode)

    def _pick(self, role: str, ids: dict[str, list[int]],
              kv_protocol: str | None = None) -> tuple[WorkerRecord, tuple[int, int], int]:
        """The worker of `role` to pick, the prompt tokens it and the best one hold, and the prompt's length on it;
        each worker's overlap is looked up with the prompt's ids as that worker encodes them."""
        workers = self._pool.healthy(role, kv_protocol) or self._pool.healthy(role)
        cached = [self.indexes.overlaps(ids[encoding_of(w)], [w.key])[0] for w in workers]
        turn = self._turns[role] = self._turns[role] + 1
        weight = self._config.leg_tokens * (DECODE_LEG_FACTOR if role == "decode" else 1)
        prompt_len = max(len(v) for v in ids.values())
        legs = [self._legs(w) for w in workers]
        queued = None
        if role == "prefill" and self._config.queued:
            queued = [queued_tokens(self._recent.get(w.key, ()), n) for w, n in zip(workers, legs)]
        i = choose(prompt_len, cached, legs, turn, weight, queued)
        own_len = len(ids[encoding_of(workers[i])])
        if role == "prefill":
            self._recent.setdefault(workers[i].key, deque(maxlen=_RECENT_LEGS)).append(max(own_len - cached[i], 0))
        return workers[i], (cached[i], max(cached)), own_len


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("routing (kv: di mode only)")
    group.add_argument("--routing", choices=ROUTINGS, default="round_robin",
                       help="round_robin: workers in turn (default); least_loaded: the worker of the role with the "
                            "fewest legs in flight, in turn among equals (a worker that fell behind, or one just "
                            "joined, evens out); kv: the prefill and decode workers that hold "
                            "most of the prompt's KV, weighed against their legs in flight, from the KV cache events "
                            "the workers publish (needs --tokenizer)")
    group.add_argument("--kv-events", action="append", default=[], metavar="HOST:PORT=tcp://HOST:PORT",
                       help="the KV events endpoint of the worker at HOST:PORT (repeat), for `vllm serve "
                            "--kv-events-config` workers; our workers name theirs in their record")
    group.add_argument("--kv-load-tokens", type=int, default=DEFAULT_LEG_TOKENS, metavar="N",
                       help=f"prompt tokens one prefill leg in flight on a worker weighs as, a decode leg "
                            f"{DECODE_LEG_FACTOR} times more (default {DEFAULT_LEG_TOKENS})")
    group.add_argument("--kv-load-queued-tokens", action=argparse.BooleanOptionalAction, default=True,
                       help="a prefill worker's load also counts the prompt tokens its legs in flight have yet to "
                            "compute (those they did not find cached there), besides --kv-load-tokens per leg "
                            "(default on)")


def routing_config(args: argparse.Namespace, tokenizer: Callable[[str], Tokenizer]) -> KVRoutingConfig | None:
    """--routing kv's settings (None for the other routings); ConfigError for flags that do not fit."""
    if args.routing != "kv":
        if args.kv_events:
            raise ConfigError("--kv-events: only with --routing kv")
        return None
    if args.mode == "colocated":
        raise ConfigError("--routing kv is for di mode (prefill and decode workers)")
    if not args.tokenizer:
        raise ConfigError("--routing kv needs --tokenizer PATH|builtin to hash prompts as the workers do")
    if args.kv_load_tokens < 0:
        raise ConfigError(f"--kv-load-tokens must be at least 0, got {args.kv_load_tokens}")
    endpoints = []
    for given in args.kv_events:
        address, sep, endpoint = given.partition("=")
        if not sep or ":" not in address or not endpoint.startswith("tcp://"):
            raise ConfigError(f"--kv-events {given!r}: expected HOST:PORT=tcp://HOST:PORT")
        endpoints.append((address, endpoint))
    return KVRoutingConfig(tokenizer(args.tokenizer), tuple(endpoints), args.kv_load_tokens,
                           queued=args.kv_load_queued_tokens)


def start_kv_routing(config: KVRoutingConfig, pool: WorkerPool, legs: Callable[[WorkerRecord], int],
                     registry: CollectorRegistry) -> tuple[KVRouter, KVEventsFollower]:
    """The router and the follower that feeds its indexes (run `follower.run` as a task)."""
    indexes = KVIndexes(config.capacity)
    follower = KVEventsFollower(indexes, KVEventMetrics(registry), dict(config.static_endpoints))
    return KVRouter(config, pool, indexes, legs, registry), follower
