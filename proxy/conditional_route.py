"""Conditional disaggregation in the request path: live figures in, ConditionalPolicy's path out.

Every figure is the proxy's own, so deciding never waits on a worker: the prompt's token count
(the model's tokenizer, run in a thread so a long prompt does not hold up the event loop), the decode
worker's cached prefix (a PrefixIndex per decode worker) and the prefill queue (the prefill legs in
flight, counted by the forwarder).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Sequence

from common.tokenizer import Tokenizer
from common.worker_record import OUR_SERVER
from proxy.conditional import LOCAL, REMOTE, ConditionalPolicy, prefill_queue
from proxy.metrics import Metrics
from proxy.kv_index import KVIndexes
from proxy.prefix_index import DEFAULT_BLOCK_SIZE, PrefixIndex
from proxy.prompt_tokens import encoding_of, prompt_token_ids
from proxy.requests import ClientRequest
from proxy.workers import VLLM_SERVER, WorkerRecord


@dataclass(frozen=True, slots=True)
class ConditionalConfig:
    """Conditional disaggregation's settings: the policy, the tokenizer and the workers' KV block size."""

    tokenizer: Tokenizer = field(compare=False)
    policy: ConditionalPolicy = ConditionalPolicy()
    block_size: int = DEFAULT_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class Decision:
    """A request's path: `local`, its decode worker serves it alone; `prompt`: its token ids, which the decode
    worker that takes its leg caches (None: not indexed)."""

    local: bool
    prompt: list[int] | None = None


class ConditionalRouter:
    """Decides each request's path and counts it; remembers the prompts each decode worker took a leg of, whose
    full blocks it caches whether it prefilled them itself or pulled them (prefix-aware transfer). With `events`
    (the workers' KV cache events, --routing kv) the decode worker's cache is what its events say instead."""

    def __init__(self, config: ConditionalConfig, metrics: Metrics, events: KVIndexes | None = None) -> None:
        self._config = config
        self._metrics = metrics
        self._events = events
        self._indexes: dict[str, PrefixIndex] = {}

    async def decide(self, request: ClientRequest, decode: WorkerRecord, prefill_legs: Sequence[int]) -> Decision:
        """The path of `request` weighed against `decode`'s cache, counted once; `prefill_legs`: the legs in flight
        per healthy prefill worker. A prompt the proxy cannot count goes the remote way, and so does a seeded one
        to a `vllm serve` decode worker: its prefill there may be cut into chunks, which vLLM's CPU build cannot
        do for a seeded request (it stops its engine), while as a decode leg it computes one token."""
        ids = await asyncio.to_thread(prompt_token_ids, request, self._config.tokenizer,
                                      encoding_of(decode) if self._events is not None else OUR_SERVER)
        path, prompt = REMOTE, None
        if ids is not None and not (request.seed is not None and decode.server == VLLM_SERVER):
            cached = (self._events.overlaps(ids, [decode.key])[0] if self._events is not None
                      else self._index(decode).cached_tokens(ids))
            path, prompt = self._config.policy.path(len(ids), cached, prefill_queue(prefill_legs)), ids
        self._metrics.paths.labels(path).inc()
        return Decision(path == LOCAL, prompt)

    def record(self, decode: WorkerRecord, decision: Decision) -> None:
        """`decode` took the decided request's leg: it caches the prompt's full blocks from now on."""
        if decision.prompt is not None and self._events is None:
            self._index(decode).add(decision.prompt)

    def _index(self, decode: WorkerRecord) -> PrefixIndex:
        index = self._indexes.get(decode.key)
        if index is None:
            index = self._indexes[decode.key] = PrefixIndex(self._config.block_size)
        return index

    def forget(self, worker: WorkerRecord) -> None:
        """`worker` is gone: whatever it cached is (or will be, when it comes back) gone too."""
        self._indexes.pop(worker.key, None)
