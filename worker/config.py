"""Engine configuration."""
from __future__ import annotations

from dataclasses import dataclass

from common.roles import ROLES
from worker.dtype import resolve_dtype

# Tokens per step: with chunked prefill a step takes about as long as this many prompt tokens,
# the longest a running stream waits for its next token while prompts are being prefilled.
DEFAULT_CHUNKED_BUDGET = 512
DEFAULT_UNCHUNKED_BUDGET = 4096   # whole prompts batched together, a lone one may exceed it
CHUNKED_BY_DEFAULT = ("both", "decode")  # roles whose running streams a long prefill would stall
# Prompts of at most this many tokens run in steps of their own, ahead of a "both" worker's decodes, which wait
# for up to decode_pause_tokens of them (scheduler/scheduler.py). Off (0) on a decode worker.
DEFAULT_SHORT_PROMPT_TOKENS = 1024
DEFAULT_DECODE_PAUSE_TOKENS = 4096
# Which finished answers' KV a decode worker writes back to their prefill worker (worker/engine/kv_write_back.py):
# none, the answers to chats under way (their messages hold an answer already: a next turn likely comes), or all.
WRITE_BACK_MODES = ("off", "chats", "all")
DEFAULT_WRITE_BACK = "chats"


@dataclass(slots=True)
class EngineConfig:
    """How to build an LLMEngine; every count is checked up front."""

    model: str | None = None               # HF-style dir; None = the built-in model
    served_model_name: str | None = None   # default: "neuron-di-builtin" or the dir name
    block_size: int = 16
    num_kv_blocks: int | None = None       # None: as many as fit in kv_cache_bytes
    kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None   # None: DEFAULT_CHUNKED_BUDGET or DEFAULT_UNCHUNKED_BUDGET
    enable_chunked_prefill: bool | None = None  # None: on for the roles in CHUNKED_BY_DEFAULT
    short_prompt_tokens: int | None = None  # None: DEFAULT_SHORT_PROMPT_TOKENS for role both, else 0 (off)
    decode_pause_tokens: int = DEFAULT_DECODE_PAUSE_TOKENS   # prompt tokens short prompts may run ahead of decodes
    max_waiting: int = 256                 # bounded waiting queue
    max_model_len: int | None = None       # default: the model's max_position_embeddings
    dtype: str = "float32"                 # or "auto": resolved at once (worker/dtype.py)
    seed: int = 0
    role: str = "both"
    enable_prefix_caching: bool = True
    prefix_aware_transfer: bool = True     # decode: pull only the blocks the prefix cache lacks

    def __post_init__(self) -> None:
        positive = ("block_size", "kv_cache_bytes", "max_num_seqs", "max_waiting", "decode_pause_tokens")
        for name in positive:
            _check_positive_int(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.short_prompt_tokens is not None and self.short_prompt_tokens != 0:
            _check_positive_int("short_prompt_tokens (or 0)", self.short_prompt_tokens)
        self.dtype = resolve_dtype(self.dtype)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.chunked_prefill and self.token_budget < self.max_num_seqs:
            raise ValueError(f"with chunked prefill max_num_batched_tokens ({self.token_budget}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): every step decodes every running request")

    @property
    def chunked_prefill(self) -> bool:
        """Whether long prompts are prefilled in chunks between decode steps' tokens."""
        if self.enable_chunked_prefill is None:
            return self.role in CHUNKED_BY_DEFAULT
        return self.enable_chunked_prefill

    @property
    def short_prompts(self) -> int:
        """Prompts of at most this many tokens run ahead of the decodes (0: none do; chunked prefill only)."""
        if not self.chunked_prefill:
            return 0
        if self.short_prompt_tokens is None:
            return DEFAULT_SHORT_PROMPT_TOKENS if self.role == "both" else 0
        return self.short_prompt_tokens

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute (unchunked, one prompt alone may exceed it)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.chunked_prefill:   # every step decodes every running request
            return max(DEFAULT_CHUNKED_BUDGET, self.max_num_seqs)
        return DEFAULT_UNCHUNKED_BUDGET


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
