"""Fixtures for the engine tests: tiny HF checkpoints written by transformers itself."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.byte_tokenizer import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, VOCAB_SIZE, build_byte_tokenizer

TINY = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)


def make_hf_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Random-weight checkpoint saved by transformers, plus our byte-level tokenizer.json."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(TINY | overrides)))
    with torch.no_grad():  # HF's init is tiny; larger weights make the logit comparison meaningful
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if param.dim() == 1 else 0.15)
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        f'{{"bos_token": "{BOS_TOKEN}", "eos_token": "{EOS_TOKEN}"}}')
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # The test machine is shared; one intra-op thread keeps runs predictable.
    torch.set_num_threads(1)
