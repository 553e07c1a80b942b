"""A model directory for serving tests: the built-in model, or a tiny random one while it is absent."""
from __future__ import annotations

from pathlib import Path

import torch

from worker.model.bench_model import BENCH_CONFIG
from worker.model.checkpoint import save_checkpoint
from worker.model.loader import builtin_model_path
from worker.model.model_config import ModelConfig
from worker.model.llama import LlamaForCausalLM


def tiny_model_dir(tmp: Path) -> Path:
    """The built-in model if this checkout has it; otherwise a 2-layer random model written under `tmp`."""
    builtin = builtin_model_path()
    if (builtin / "config.json").exists():
        return builtin
    config = ModelConfig(
        vocab_size=BENCH_CONFIG.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=BENCH_CONFIG.bos_token_id, eos_token_ids=BENCH_CONFIG.eos_token_ids)
    model = LlamaForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    save_checkpoint(model, tmp / "tiny-model")
    return tmp / "tiny-model"
