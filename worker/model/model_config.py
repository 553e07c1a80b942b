"""The architecture hyper-parameters of a Llama-family checkpoint, read from `config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(slots=True)
class ModelConfig:
    """What the decoder needs to know; field names follow HF `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    sliding_window: int | None = None  # attention span limit (Mistral); None = full context
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> ModelConfig:
        heads = data["num_attention_heads"]
        eos = data.get("eos_token_id")
        if data.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        # Newer transformers folds rope_theta and the scaling into one "rope_parameters" dict.
        rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", data.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            tie_word_embeddings=data.get("tie_word_embeddings", False),
            # Qwen2 always has a q/k/v bias; Llama makes it optional.
            attention_bias=data.get("attention_bias", data.get("model_type") == "qwen2"),
            model_type=data.get("model_type", "llama"),
            # Qwen2 configs carry a window they do not use unless use_sliding_window is set.
            sliding_window=data.get("sliding_window") if data.get("use_sliding_window", True) else None,
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [eos],
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        try:
            data = json.loads(config_path.read_text())
            return cls.from_hf(data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read a Llama-family config from {config_path}: {exc!r}") from exc

    def to_hf(self) -> dict[str, Any]:
        """A `config.json` that transformers' LlamaForCausalLM (or Qwen2) loads as this model."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        data = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "eos_token_ids"}
        data["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids
        data["architectures"] = [arch[self.model_type]]
        data["hidden_act"] = "silu"
        data["torch_dtype"] = "float32"
        return data
