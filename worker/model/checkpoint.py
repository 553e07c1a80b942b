"""Writing a model as an HF-style directory with the byte-level tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.byte_tokenizer import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, build_byte_tokenizer
from worker.model.llama import LlamaForCausalLM, unpack_checkpoint

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def save_checkpoint(model: LlamaForCausalLM, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """config.json, model.safetensors, tokenizer.json and tokenizer_config.json in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    # Tied weights: store only the embedding, as HF does.
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in unpack_checkpoint(model).items()
               if not (config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = config.to_hf() | {"torch_dtype": _DTYPE_NAMES[dtype]}
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    tokenizer_config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "chat_template": CHAT_TEMPLATE,
                        "model_max_length": config.max_position_embeddings}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
