"""A request inside the engine: scheduling state plus what sampling and detokenizing need."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scheduler import Sequence
from worker.detokenizer import IncrementalDetokenizer
from worker.sampling_params import SamplingParams


@dataclass(slots=True, eq=False, kw_only=True)
class Request(Sequence):
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    pull_target: Any = None          # decode: the kv_connector.PullTarget its prompt's KV comes from
