"""The simulated model: a real tokenizer, a tiny KV layout, and a runner that sleeps through the cost model.

Each step writes every computed position's token id into its KV slot, and a sampled sequence's next
token is a hash of the token ids its KV blocks hold (positions 0 .. its length): so a decode worker
whose pulled KV were wrong would answer differently from a `both` worker, as with a real model.
Tokens are printable, never EOS: a request runs to its max_tokens. Each is certain: its logprob is 0.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.tokenizer import Tokenizer
from scheduler import ScheduledStep
from transfer.layout import KVLayout
from worker.config import EngineConfig
from worker.mock.cost_model import CostModel
from worker.model.loader import BUILTIN_MODEL_NAME, builtin_model_path, load_config
from worker.model.model_config import ModelConfig
from worker.model.logprobs import TokenLogprobs
from worker.model.runner import StepResult
from worker.model.tokenizer import load_tokenizer

MAX_POSITIONS = 1 << 17   # no position is computed: the context is bounded by the KV pool only
_HASH_MODULUS = (1 << 31) - 1
_MASK_64 = (1 << 64) - 1


@dataclass(slots=True)
class MockModel:
    """A model's tokenizer and vocabulary with no weights: one layer, one KV head of two values a slot."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    cost: CostModel
    real: ModelConfig   # the model simulated: its KV capacity is the simulation's

    @classmethod
    def load(cls, model_dir: str | None, cost: CostModel) -> MockModel:
        """Reads only `model_dir`'s config and tokenizer (None: the built-in model's)."""
        path = Path(model_dir) if model_dir is not None else builtin_model_path()
        real = load_config(path)
        config = replace(real, hidden_size=2, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=2, max_position_embeddings=max(real.max_position_embeddings, MAX_POSITIONS),
                         sliding_window=None)
        return cls(config, load_tokenizer(path, real), BUILTIN_MODEL_NAME if model_dir is None else path.name, cost,
                   real)

    def with_real_capacity(self, config: EngineConfig) -> EngineConfig:
        """`config` with the KV blocks the simulated model would have in its `kv_cache_bytes` (when it
        names no number of blocks): the tiny layout alone would give hundreds of times more."""
        if config.num_kv_blocks is not None:
            return config
        one_block = KVLayout(self.real.num_hidden_layers, 1, config.block_size, self.real.num_key_value_heads,
                             self.real.head_dim, config.dtype)
        return replace(config, num_kv_blocks=max(config.kv_cache_bytes // one_block.block_bytes, 1))

    def runner(self, kv_pool: torch.Tensor, block_size: int) -> MockRunner:
        return MockRunner(self.cost, kv_pool, block_size, _token_choices(self.config))


def _token_choices(config: ModelConfig) -> torch.Tensor:
    """Printable ASCII ids where the vocabulary has them (the built-in model's bytes), never an EOS id."""
    ids = range(32, 127) if config.vocab_size >= 127 else range(config.vocab_size)
    return torch.tensor([t for t in ids if t not in config.eos_token_ids], dtype=torch.int64)


def _certain(wanted: int | None, token_id: int) -> TokenLogprobs | None:
    """The logprobs of a token chosen with certainty (the simulated engine's are), where they are asked for."""
    if wanted is None:
        return None
    return TokenLogprobs(token_id, 0.0, 1, ((token_id, 0.0),) if wanted else ())


class MockRunner:
    """Runs a step in the time the cost model gives it; tokens from the KV the sequences hold."""

    def __init__(self, cost: CostModel, kv_pool: torch.Tensor, block_size: int, choices: torch.Tensor) -> None:
        # (layers=1, k/v, blocks, block_size, heads=1, head_dim=2): the K plane, one row of 2 values per slot
        self.slots = kv_pool[0, 0].reshape(-1, kv_pool.shape[-1])
        self.cost = cost
        self.block_size = block_size
        self.choices = choices
        self.offsets = torch.arange(block_size, dtype=torch.int64)
        self.weights = torch.zeros(0, dtype=torch.int64)

    def run(self, step: ScheduledStep) -> StepResult:
        started = time.perf_counter()
        for chunk in step.chunks:
            positions = torch.arange(chunk.start, chunk.start + chunk.num_tokens, dtype=torch.int64)
            ids = torch.tensor(chunk.seq.token_ids[chunk.start:chunk.start + chunk.num_tokens], dtype=torch.float32)
            self.slots[self._slots(chunk.seq.block_table, positions), 0] = ids
        tokens = [self._next_token(seq.block_table, len(seq)) for seq in step.sampled]
        time.sleep(max(0.0, started + self.cost.step_seconds(step) - time.perf_counter()))
        return StepResult(tokens, [_certain(seq.params.logprobs, token) for seq, token in zip(step.sampled, tokens)], [])

    def _slots(self, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
        blocks = torch.tensor(block_table, dtype=torch.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _next_token(self, block_table: list[int], length: int) -> int:
        blocks = torch.tensor(block_table[:(length + self.block_size - 1) // self.block_size], dtype=torch.int64)
        slots = (blocks[:, None] * self.block_size + self.offsets).reshape(-1)[:length]
        held = self.slots[slots, 0].to(torch.int64)
        digest = int((held * self._weights(length)).sum()) % _HASH_MODULUS
        mixed = (digest * 0x9E3779B97F4A7C15 + length) & _MASK_64   # spreads digests that differ in few bits
        return int(self.choices[(mixed ^ (mixed >> 29)) % len(self.choices)])

    def _weights(self, length: int) -> torch.Tensor:
        """Position weights, so the hash depends on the order of the tokens, not only on their sum."""
        if len(self.weights) < length:
            positions = torch.arange(max(length, 2 * len(self.weights)), dtype=torch.int64)
            self.weights = (positions * 2654435761 + 97) % 65521 + 1
        return self.weights[:length]
