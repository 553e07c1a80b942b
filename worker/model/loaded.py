"""A model loaded once, and the runner it gives each engine built on it.

An engine asks its model for a runner over its KV pool. A checkpoint's model computes real forward
passes (runner.py); the simulated one (worker/mock/) stands in with a cost model. A worker that
changes role builds a new engine on the model it loaded already.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from common.tokenizer import Tokenizer
from scheduler import ScheduledStep
from worker.model.llama import LlamaForCausalLM
from worker.model.loader import BUILTIN_MODEL_NAME, builtin_model_path, load_config, load_model
from worker.model.model_config import ModelConfig
from worker.model.runner import ModelRunner, StepResult
from worker.model.tokenizer import load_tokenizer


class StepRunner(Protocol):
    """Computes one scheduled step: the token sampled for each of `step.sampled`, in order, and the logprobs asked for."""

    def run(self, step: ScheduledStep) -> StepResult: ...


class LoadedModel(Protocol):
    """What an engine needs of its model: its architecture, tokenizer, name, and a runner for a KV pool."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str

    def runner(self, kv_pool: torch.Tensor, block_size: int) -> StepRunner: ...


@dataclass(slots=True)
class CheckpointModel:
    """A Llama-family checkpoint's weights in memory."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    model: LlamaForCausalLM

    @classmethod
    def load(cls, model_dir: str | None, dtype: torch.dtype) -> CheckpointModel:
        """The model in `model_dir` (None: the built-in model); ModelLoadError if it cannot be loaded."""
        path = Path(model_dir) if model_dir is not None else builtin_model_path()
        config = load_config(path)
        tokenizer = load_tokenizer(path, config)
        return cls(config, tokenizer, BUILTIN_MODEL_NAME if model_dir is None else path.name,
                   load_model(path, config, dtype))

    def runner(self, kv_pool: torch.Tensor, block_size: int) -> ModelRunner:
        return ModelRunner(self.model.to(kv_pool.device), kv_pool, block_size, tuple(self.tokenizer.eos_token_ids))
