"""The scheduler side's bookkeeping, sans vLLM: what the worker side must publish, discard, pull or release.

vLLM's scheduler calls the connector's hooks; they turn into `Publish`, `Pull`, `Release` and
discard orders, handed to the worker side once per step as `StepOrders` (inside vLLM's connector
metadata). Block ids are vLLM's; request ids pair vLLM's own id with the proxy's `uid`,
the id both legs share on the signal plane.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Publish:
    """Prefill finished: hold `block_ids` for the decode peer's lookup of `uid`."""

    request_id: str
    uid: str
    block_ids: tuple[int, ...]
    output_token: int


@dataclass(frozen=True, slots=True)
class Pull:
    """Decode admitted a request: pull the prompt's KV of `uid` from the prefill peer
    (`engine_id`: the prefill engine the proxy named, None when it named none)."""

    request_id: str
    uid: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    engine_id: str | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """Decode: a request ended without pulling: the prefill peer at host:port may free `uid`'s blocks."""

    uid: str
    host: str
    port: int


@dataclass(slots=True)
class StepOrders:
    """Everything the scheduler side decided since the last step."""

    publish: list[Publish] = field(default_factory=list)
    discard: list[str] = field(default_factory=list)     # uids ended before they could be published
    pull: list[Pull] = field(default_factory=list)
    release: list[Release] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LegParams:
    """A request's `kv_transfer_params` as the proxy sends them."""

    role: str
    uid: str
    host: str = ""
    port: int = 0
    engine_id: str | None = None

    @classmethod
    def parse(cls, params: dict[str, Any] | None, our_role: str) -> LegParams | None:
        """The params of a leg for this worker's role; None (logged) when absent or malformed,
        since a bad request must not stop the engine: it is then served without DI."""
        if not params or params.get("role") != our_role:
            if params:
                log.warning("kv_transfer_params %r are not for a %s worker; serving without DI", params, our_role)
            return None
        uid, host, port = params.get("request_id"), params.get("remote_host", ""), params.get("remote_port", 0)
        if not isinstance(uid, str) or not uid:
            log.warning("kv_transfer_params %r lack request_id; serving without DI", params)
            return None
        if our_role == "decode" and (not isinstance(host, str) or not host or isinstance(port, bool)
                                     or not isinstance(port, int) or not 0 < port < 65536):
            log.warning("kv_transfer_params %r lack a prefill address; serving without DI", params)
            return None
        engine_id = params.get("remote_engine_id") if our_role == "decode" else None
        if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
            log.warning("kv_transfer_params %r name no usable prefill engine; serving without DI", params)
            return None
        return cls(our_role, uid, host, port, engine_id)


def blocks_holding(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def prompt_blocks(block_ids: list[int], num_prompt_tokens: int, block_size: int) -> tuple[int, ...]:
    """The blocks that hold the prompt's KV (a finished prefill also holds its sampled token's slot)."""
    return tuple(block_ids[:blocks_holding(num_prompt_tokens, block_size)])


def blocks_to_pull(block_ids: list[int], num_prompt_tokens: int, num_external_tokens: int,
                   block_size: int) -> tuple[int, ...]:
    """The prompt blocks decode must receive: all but the full blocks its prefix cache supplied."""
    cached = (num_prompt_tokens - num_external_tokens) // block_size
    return tuple(block_ids[cached:blocks_holding(num_prompt_tokens, block_size)])


class SchedulerPlan:
    """The scheduler side of one worker: requests of its role, orders for the worker side."""

    def __init__(self, role: str, block_size: int) -> None:
        self.role = role
        self.block_size = block_size
        self._legs: dict[str, LegParams] = {}
        self._pulled: set[str] = set()   # a preempted request computes again instead of pulling twice
        self._orders = StepOrders()

    def leg(self, request_id: str, params: dict[str, Any] | None) -> LegParams | None:
        """The request's leg params (parsed once per request)."""
        if request_id not in self._legs:
            leg = LegParams.parse(params, self.role)
            if leg is None:
                return None
            self._legs[request_id] = leg
        return self._legs[request_id]

    def matched_tokens(self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int,
                       num_computed_tokens: int) -> int:
        """Decode: the prompt tokens the prefill peer supplies (vLLM recomputes the last one)."""
        if self.role != "decode" or request_id in self._pulled or self.leg(request_id, params) is None:
            return 0
        return max(0, num_prompt_tokens - num_computed_tokens)

    def allocated(self, request_id: str, params: dict[str, Any] | None, block_ids: list[int],
                  num_prompt_tokens: int, num_external_tokens: int) -> None:
        """Decode: blocks are allocated for the external tokens: pull into them."""
        leg = self.leg(request_id, params) if self.role == "decode" else None
        if leg is None or num_external_tokens <= 0:
            return
        dst = blocks_to_pull(block_ids, num_prompt_tokens, num_external_tokens, self.block_size)
        self._pulled.add(request_id)
        self._orders.pull.append(Pull(request_id, leg.uid, leg.host, leg.port, dst, leg.engine_id))

    def finished(self, request_id: str, params: dict[str, Any] | None, block_ids: list[int],
                 num_prompt_tokens: int, first_token: int | None) -> bool:
        """A request ended; True when its blocks stay held for the decode peer.

        `first_token` is the token prefill sampled when the request ended at its one-token
        limit, None when it ended otherwise (stop, abort, error): the peer is told at once.
        A decode leg that ended before its pull was ordered (say, aborted while it waited)
        has its prefill peer told to free the blocks; one that pulled is the worker side's.
        """
        leg = self.leg(request_id, params)
        pulled = request_id in self._pulled
        self._legs.pop(request_id, None)
        self._pulled.discard(request_id)
        if self.role == "decode" and leg is not None and not pulled:
            self._orders.release.append(Release(leg.uid, leg.host, leg.port))
        if self.role != "prefill" or leg is None:
            return False
        blocks = prompt_blocks(block_ids, num_prompt_tokens, self.block_size)
        if first_token is None or not blocks:
            self._orders.discard.append(leg.uid)
            return False
        self._orders.publish.append(Publish(request_id, leg.uid, blocks, first_token))
        return True

    def take_orders(self) -> StepOrders:
        orders, self._orders = self._orders, StepOrders()
        return orders
