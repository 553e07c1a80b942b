"""The ~24M-parameter benchmark model: random weights, made deterministically on first use.

Its context is 4096 tokens, so a 2000-token prompt and its answer fit with room to spare.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from common.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from worker.model.checkpoint import save_checkpoint
from worker.model.model_config import ModelConfig
from worker.model.llama import LlamaForCausalLM

BENCH_CONFIG = ModelConfig(
    vocab_size=VOCAB_SIZE, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_ids=[EOS_ID],
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "neuron-di"


def create_bench_model(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Path of an HF-style dir holding the benchmark model; built once per (cache dir, seed).

    The directory is named after the context length too, so a copy cached with another one
    (whose config.json says so) is never taken for this model.
    """
    context = f"ctx{BENCH_CONFIG.max_position_embeddings // 1024}k"
    out = Path(cache_dir or default_cache_dir()) / f"bench-llama-24m-{context}-seed{seed}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build in a scratch dir and rename, so a concurrent or interrupted build never leaves half a model.
    scratch = Path(tempfile.mkdtemp(prefix=out.name, dir=out.parent))
    try:
        model = LlamaForCausalLM(BENCH_CONFIG)
        model.init_weights(torch.Generator().manual_seed(seed))
        save_checkpoint(model, scratch)
        scratch.rename(out)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out
