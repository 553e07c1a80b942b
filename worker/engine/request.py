"""A request inside the engine (scheduling state plus what sampling and detokenizing need), and its outputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from scheduler import Sequence
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.model.logprobs import TokenLogprobs
from worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from common.handoff import DecodeParams
    from worker.model.grammar import Grammar
    from worker.multimodal.embeds import ImageEmbeds


@dataclass(slots=True, eq=False, kw_only=True)
class Request(Sequence):
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    pull_target: DecodeParams | None = None   # decode: where its prompt's KV comes from
    write_back_target: DecodeParams | None = None   # decode, with write-back: the prefill worker it was pulled from
    continues_chat: bool = False   # a chat whose messages hold an answer already (write-back "chats" takes it)
    mm: tuple[tuple[int, ImageEmbeds], ...] = ()   # (start, embeds): input rows of positions start.. (mm_spans)
    # With params.prompt_logprobs: one entry per prompt token computed so far (the first has none).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    grammar: Grammar | None = None   # structured output: where its output stands in its grammar

    def advance(self, token_id: int) -> None:
        """Takes note of a new output token (its grammar, if any, moves past it)."""
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def add_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """Records the entries of prompt tokens first.. that are not recorded yet (a preempted request recomputes)."""
        assert self.prompt_logprobs is not None
        for position, entry in enumerate(entries, first):
            if position == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None        # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: Exception | None = None   # set when the request failed (finish_reason "error")
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it (not EOS)
    # Where the request asks for logprobs: one per new token; None for a token sampled elsewhere
    # (a decode leg's first token, the prefill worker's).
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # on the first output, if asked for
