"""What NeuronConnector's scheduler side tells its worker side each step (`StepOrders`, inside vLLM's
connector metadata), and the plain view of a step's scheduled requests the scheduler side reads.

Block ids are vLLM's; request ids pair vLLM's own id with the proxy's `uid`, the id both legs share
on the signal plane.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Publish:
    """Prefill: this step computes the last of the prompt's KV: once its forward is done, hold
    `block_ids` for the decode peer's lookup of `uid`. `output_token`: the prefill's first token,
    None when it is not known yet (a vLLM decode worker samples it again itself)."""

    request_id: str
    uid: str
    block_ids: tuple[int, ...]
    output_token: int | None = None


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
class RemotePrefill:
    """Decode, decode_first flow: send the prefill worker at `url` the prefill leg `body` of `uid`
    (the prompt's token ids, one token); its KV then comes as any decode leg's does."""

    uid: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Release:
    """Decode: a request ended without pulling: the prefill peer at host:port may free `uid`'s blocks."""

    uid: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Mark:
    """A phase of request `uid`'s timeline the scheduler side saw at `at` (time.time())."""

    uid: str
    phase: str
    at: float


@dataclass(slots=True)
class StepOrders:
    """Everything the scheduler side decided since the last step."""

    publish: list[Publish] = field(default_factory=list)
    discard: list[str] = field(default_factory=list)     # uids ended without a pull: free their blocks
    pull: list[Pull] = field(default_factory=list)
    prefill: list[RemotePrefill] = field(default_factory=list)
    release: list[Release] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)      # for the worker side's timeline
    expect: list[tuple[str, str]] = field(default_factory=list)   # (uid, the decode engine that will pull it)
    traced: dict[str, str] = field(default_factory=dict)  # uid -> the traceparent its HTTP request carried
    idle: bool = False                                   # the step runs no tokens


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One request of a step, as vLLM's scheduler output shows it: `new_blocks` are its block ids
    (all of them when `replaced`: first scheduled or resumed; else appended to those it had),
    `num_computed` its tokens computed before this step, `num_tokens` those this step computes."""

    request_id: str
    new_blocks: tuple[int, ...]
    replaced: bool
    num_computed: int
    num_tokens: int
