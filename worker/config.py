"""Engine configuration."""
from __future__ import annotations

from dataclasses import dataclass

from common.roles import ROLES

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(slots=True)
class EngineConfig:
    """How to build an LLMEngine; every count is checked up front."""

    model: str | None = None               # HF-style dir; None = the built-in model
    served_model_name: str | None = None   # default: "neuron-di-builtin" or the dir name
    block_size: int = 16
    num_kv_blocks: int | None = None       # None: as many as fit in kv_cache_bytes
    kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    max_waiting: int = 256                 # bounded waiting queue
    max_model_len: int | None = None       # default: the model's max_position_embeddings
    dtype: str = "float32"
    seed: int = 0
    role: str = "both"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        positive = ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "max_waiting")
        for name in positive:
            _check_positive_int(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
