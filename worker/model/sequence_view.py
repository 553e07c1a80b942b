"""What the model side (runner, sampler) reads of a scheduled sequence: the engine's requests have it.

A protocol rather than the engine's request type, so `worker.model` never imports `worker.engine`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from worker.model.logprobs import TokenLogprobs
from worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.model.grammar import Grammar
    from worker.multimodal.embeds import ImageEmbeds


class SequenceView(Protocol):
    """One sequence as the runner and the sampler see it."""

    params: SamplingParams
    generator: torch.Generator
    grammar: Grammar | None
    token_ids: list[int]
    num_prompt_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] | None
    mm: tuple[tuple[int, ImageEmbeds], ...]
    block_table: list[int]

    @property
    def output_token_ids(self) -> Sequence[int]: ...
