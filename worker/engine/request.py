"""A request inside the engine (scheduling state plus what sampling and detokenizing need), and its outputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from scheduler import Sequence
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.engine.kv_connector import PullTarget
    from worker.multimodal.embeds import ImageEmbeds


@dataclass(slots=True, eq=False, kw_only=True)
class Request(Sequence):
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    pull_target: PullTarget | None = None   # decode: where its prompt's KV comes from
    mm: tuple[tuple[int, ImageEmbeds], ...] = ()   # (start, embeds): input rows of positions start.. (mm_spans)


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
