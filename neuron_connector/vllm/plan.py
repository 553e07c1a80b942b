"""The scheduler side's bookkeeping, sans vLLM: what the worker side must publish, discard, pull, ask
for or release (orders.py), from vLLM's connector hooks and each step's scheduled requests.

Prefill: a leg's blocks are published in the step that computes the last of its prompt (the worker
side publishes them once that step's forward is done), not when vLLM reports the request finished:
an order made then rides in the next step's metadata, and vLLM runs a step's connector hooks after
its forward; when the next step was another prompt's prefill, the decode worker waited for that
whole prefill (a gap of 0.3-2 s in its stream) before it could pull.
Published blocks must stay put until pulled: while any are held, `holds_blocks` tells vLLM not to
preempt (it waits for those blocks to be released instead).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from common.held_blocks import HeldBlocks
from common.timeline import ADMITTED, FIRST_STEP
from common.handoff import DecodeParams, LegParams, PrefillParams
from neuron_connector.vllm.legs import blocks_to_pull, leg_params, prefill_leg_body, prompt_blocks
from neuron_connector.vllm.orders import Mark, Publish, Pull, Release, RemotePrefill, Scheduled, StepOrders


@dataclass(slots=True)
class _Prefill:
    """A prefill leg until it finishes: the blocks vLLM gave it, and whether they are published."""

    uid: str
    num_prompt_tokens: int
    blocks: list[int] = field(default_factory=list)
    published: bool = False


class SchedulerPlan:
    """The scheduler side of one worker: requests of its role, orders for the worker side.
    `model`: the served model name a decode worker's own prefill legs ask for (decode_first)."""

    def __init__(self, role: str, block_size: int, model: str = "") -> None:
        self.role = role
        self.block_size = block_size
        self.model = model
        self._legs: dict[str, LegParams] = {}
        self._pulled: set[str] = set()       # a preempted request computes again instead of pulling twice
        self._first_step: set[str] = set()   # pulled requests not scheduled since
        self._prefills: dict[str, _Prefill] = {}
        self._held = HeldBlocks()            # prefill: published, not released yet
        self._orders = StepOrders()

    def leg(self, request_id: str, params: dict[str, Any] | None) -> LegParams | None:
        """The request's leg params (parsed once per request)."""
        if request_id not in self._legs:
            leg = leg_params(params, self.role)
            if leg is None:
                return None
            self._legs[request_id] = leg
            if self.role == "prefill":   # the scheduler meets it: its prefill is scheduled from now on
                self._mark(leg.request_id, ADMITTED)
                if isinstance(leg, PrefillParams) and leg.request_id and leg.decode_engine_id:
                    self._orders.expect.append((leg.request_id, leg.decode_engine_id))
        return self._legs[request_id]

    def traced(self, request_id: str, trace_headers: Mapping[str, str] | None) -> None:
        """The request's trace context (vLLM keeps its HTTP request's `traceparent` when it traces)."""
        leg = self._legs.get(request_id)
        if leg is not None and trace_headers and (traceparent := trace_headers.get("traceparent")):
            self._orders.traced[leg.request_id] = traceparent

    def matched_tokens(self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int,
                       num_computed_tokens: int, prompt_token_ids: list[int] | None = None) -> int:
        """Decode: the prompt tokens the prefill peer supplies (vLLM recomputes the last one). A
        decode_first leg, met for the first time, also sends its prefill leg (`prompt_token_ids`)."""
        first = request_id not in self._legs
        leg = self.leg(request_id, params)
        if leg is None:
            return 0
        if self.role == "prefill":
            self._prefills.setdefault(request_id, _Prefill(leg.request_id, num_prompt_tokens))
            return 0
        assert isinstance(leg, DecodeParams)
        if first and leg.remote_url is not None and prompt_token_ids is not None:
            body = prefill_leg_body(self.model, leg.request_id, prompt_token_ids)
            self._orders.prefill.append(RemotePrefill(leg.request_id, leg.remote_url, body))
        if request_id in self._pulled:
            return 0
        return max(0, num_prompt_tokens - num_computed_tokens)

    def allocated(self, request_id: str, params: dict[str, Any] | None, block_ids: list[int],
                  num_prompt_tokens: int, num_external_tokens: int) -> None:
        """Decode: blocks are allocated for the external tokens: pull into them."""
        leg = self.leg(request_id, params) if self.role == "decode" else None
        if leg is None or num_external_tokens <= 0:
            return
        dst = blocks_to_pull(block_ids, num_prompt_tokens, num_external_tokens, self.block_size)
        self._mark(leg.request_id, ADMITTED)
        self._pulled.add(request_id)
        self._first_step.add(request_id)
        self._orders.pull.append(Pull(request_id, leg.request_id, leg.host, leg.port, dst, leg.engine_id))

    def scheduled(self, steps: Iterable[Scheduled]) -> None:
        """This step runs `steps`: a pulled request's first step is marked, and a prefill leg whose
        prompt this step completes is published (once the step's forward is done)."""
        for step in steps:
            if step.request_id in self._first_step:
                self._first_step.discard(step.request_id)
                self._mark(self._legs[step.request_id].request_id, FIRST_STEP)
            prefill = self._prefills.get(step.request_id)
            if prefill is None:
                continue
            prefill.blocks = list(step.new_blocks) if step.replaced else prefill.blocks + list(step.new_blocks)
            if not prefill.published and step.num_computed + step.num_tokens >= prefill.num_prompt_tokens:
                self._publish(step.request_id, prefill.uid,
                              prompt_blocks(prefill.blocks, prefill.num_prompt_tokens, self.block_size))
                prefill.published = True

    def finished(self, request_id: str, params: dict[str, Any] | None, block_ids: list[int],
                 num_prompt_tokens: int, first_token: int | None) -> bool:
        """A request ended; True when its blocks stay held until the worker side releases them.

        `first_token` is the token prefill sampled when the request ended at its one-token
        limit, None when it ended otherwise (stop, abort, error): its blocks, published or not,
        are discarded (a published leg's once any push of them ended). A decode leg that ended
        before its pull was ordered (say, aborted while it waited) has its prefill peer told to
        free the blocks; one that pulled is the worker side's.
        """
        leg = self.leg(request_id, params)
        pulled = request_id in self._pulled
        prefill = self._prefills.pop(request_id, None)
        self._legs.pop(request_id, None)
        self._pulled.discard(request_id)
        self._first_step.discard(request_id)
        if self.role == "decode" and leg is not None and not pulled:
            self._orders.release.append(Release(leg.request_id, leg.host, leg.port))
        if self.role != "prefill" or leg is None:
            return False
        if prefill is not None and prefill.published:
            if first_token is None:
                self._orders.discard.append(leg.request_id)
            return True
        blocks = prompt_blocks(block_ids, num_prompt_tokens, self.block_size)
        if first_token is None or not blocks:
            self._orders.discard.append(leg.request_id)
            return False
        self._publish(request_id, leg.request_id, blocks, first_token)
        return True

    def sent(self, request_ids: Iterable[str]) -> None:
        """The worker side released these requests' published blocks (vLLM frees them now)."""
        for request_id in request_ids:
            self._held.release(request_id)

    def holds_blocks(self) -> bool:
        """Whether published blocks wait for their pull (or release): vLLM must not preempt meanwhile."""
        return len(self._held) > 0

    def held(self) -> tuple[int, float]:
        """Blocks published and not released yet, and how long the oldest set has waited (0 when none)."""
        return self._held.snapshot()

    def take_orders(self) -> StepOrders:
        orders, self._orders = self._orders, StepOrders()
        return orders

    def _publish(self, request_id: str, uid: str, blocks: tuple[int, ...], first_token: int | None = None) -> None:
        self._held.hold(request_id, len(blocks))
        self._orders.publish.append(Publish(request_id, uid, blocks, first_token))

    def _mark(self, uid: str, phase: str) -> None:
        self._orders.marks.append(Mark(uid, phase, time.time()))
