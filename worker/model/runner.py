"""Runs the model for one scheduled step: builds the flat inputs once, forwards, samples."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.layers import paged_decode
from worker.model.layers.attention import AttentionMetadata, build_mask
from worker.model.layers.linear import pack_linears
from worker.model.llama import LlamaForCausalLM
from worker.engine.request import Request
from worker.model.sampler import sample


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor       # (tokens,)
    positions: torch.Tensor       # (tokens,)
    last_index: torch.Tensor | None   # rows of the hidden states whose logits are needed
    meta: AttentionMetadata


class ModelRunner:
    """The only part of the engine that touches tensors."""

    def __init__(self, model: LlamaForCausalLM, kv_pool: torch.Tensor, block_size: int) -> None:
        # The runner only ever runs inference: pack the CPU fp32 linears for oneDNN.
        pack_linears(model)
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.device = kv_pool.device

    @torch.inference_mode()
    def run(self, seqs: list[Request], is_prefill: bool) -> list[int]:
        inputs = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        logits = self.forward(inputs)
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs])

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits (seqs, vocab) of each sequence's last token."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.last_index is not None:
            hidden = hidden[inputs.last_index]
        return self.model.compute_logits(hidden)

    def prepare_prefill(self, seqs: list[Request]) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens = [len(s) - s.num_cached_tokens for s in seqs]
        max_query_len = max(query_lens)
        query_index: list[int] = []
        for row, seq in enumerate(seqs):
            start = seq.num_cached_tokens
            input_ids.extend(seq.token_ids[start:])
            positions.extend(range(start, len(seq)))
            query_index.extend(range(row * max_query_len, row * max_query_len + len(seq) - start))
        last_index = torch.tensor(query_lens).cumsum(0) - 1
        # Equal-length prompts with nothing cached need no mask, gather or padding (bench, single prompts).
        fresh = all(s.num_cached_tokens == 0 for s in seqs) and len(set(query_lens)) == 1
        meta = self._metadata(seqs, positions, query_lens, torch.tensor(query_index, device=self.device),
                              with_mask=not fresh)
        return StepInputs(self._tensor(input_ids), self._tensor(positions), last_index.to(self.device), meta)

    def prepare_decode(self, seqs: list[Request]) -> StepInputs:
        positions = [len(s) - 1 for s in seqs]
        meta = self._metadata(seqs, positions, [1] * len(seqs), None)
        return StepInputs(self._tensor([s.token_ids[-1] for s in seqs]), self._tensor(positions), None, meta)

    def _metadata(self, seqs: list[Request], positions: list[int], query_lens: list[int],
                  query_index: torch.Tensor | None, with_mask: bool = True) -> AttentionMetadata:
        bs = self.block_size
        slots, row = [], 0
        for seq, n in zip(seqs, query_lens):
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in positions[row:row + n])
            row += n
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        context_lens = [len(s) for s in seqs]
        # The native decode loops stop at each context's end: they need no mask.
        native_decode = query_index is None and paged_decode.applies(self.kv_pool)
        mask = None
        if with_mask and not native_decode:
            mask = build_mask(torch.tensor(context_lens), torch.tensor(query_lens), max(query_lens), max_blocks * bs,
                              self.kv_pool.dtype).to(self.device)
        return AttentionMetadata(kv_pool=self.kv_pool, slot_mapping=self._tensor(slots),
                                 block_tables=self._tensor(tables), context_lens=self._tensor(context_lens),
                                 max_context_len=max(context_lens), mask=mask, query_index=query_index)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
