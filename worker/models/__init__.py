"""Model architectures."""
from __future__ import annotations

from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig"]
