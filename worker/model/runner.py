"""Runs the model for one scheduled step: builds the flat inputs once, forwards, samples."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.model.layers import paged_decode
from scheduler import ScheduledChunk, ScheduledStep
from worker.model.layers.attention import AttentionMetadata, SeqGroup, build_mask, chunks_need_mask
from worker.model.layers.linear import pack_linears
from worker.model.llama import InputRows, LlamaForCausalLM
from worker.model.logprobs import TokenLogprobs, log_softmax, token_logprobs
from worker.model.sampler import sample
from worker.model.sequence_view import SequenceView


PROMPT_LOGITS_ROWS = 256   # prompt positions whose logits are made at once


@dataclass(slots=True)
class PromptRows:
    """Logits rows `row` .. `row + count - 1` predict prompt tokens `first` .. `first + count - 1` of `seq`."""

    seq: SequenceView
    first: int
    row: int
    count: int


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor       # (tokens,)
    positions: torch.Tensor       # (tokens,)
    last_index: torch.Tensor | None   # rows of the hidden states whose logits are needed; None: all
    meta: AttentionMetadata
    input_rows: InputRows | None = None   # image embeddings replacing some rows' token embeddings
    sample_rows: list[int] | None = None  # the logits rows sampled from, in step.sampled order; None: all
    prompt_rows: list[PromptRows] = field(default_factory=list)   # for requests that want prompt logprobs


@dataclass(slots=True)
class StepResult:
    token_ids: list[int]                          # one per step.sampled
    logprobs: list[TokenLogprobs | None]          # one per step.sampled: where its request asks for them
    prompt_logprobs: list[tuple[SequenceView, int, list[TokenLogprobs]]]   # (seq, first prompt position, entries)


class ModelRunner:
    """The only part of the engine that touches tensors."""

    def __init__(self, model: LlamaForCausalLM, kv_pool: torch.Tensor, block_size: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        # The runner only ever runs inference: pack the CPU linears for oneDNN.
        pack_linears(model)
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.device = kv_pool.device
        self.eos_token_ids = eos_token_ids   # what min_tokens keeps from being sampled (unless ignore_eos)

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> StepResult:
        """The token sampled for each of `step.sampled`, in that order, and the logprobs asked for."""
        inputs = self.prepare(step)
        hidden = self.hidden(inputs)
        sampled: list[SequenceView] = step.sampled   # type: ignore[assignment]  # the engine schedules its requests
        rows = hidden if inputs.sample_rows is None else hidden[inputs.sample_rows]
        token_ids, logprobs = sample(self.model.compute_logits(rows), sampled, self.eos_token_ids)
        prompt = [(p.seq, p.first, self._prompt_logprobs(hidden[p.row:p.row + p.count], p))
                  for p in inputs.prompt_rows]
        return StepResult(token_ids, logprobs, prompt)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: PromptRows) -> list[TokenLogprobs]:
        """Logprobs of prompt tokens rows.first.., their logits made a slice at a time: a long prompt's
        (tokens, vocab) logits at once could take gigabytes."""
        targets = rows.seq.token_ids[rows.first:rows.first + rows.count]
        k = rows.seq.params.prompt_logprobs or 0
        entries: list[TokenLogprobs] = []
        for start in range(0, rows.count, PROMPT_LOGITS_ROWS):
            logits = self.model.compute_logits(hidden[start:start + PROMPT_LOGITS_ROWS])
            entries += token_logprobs(log_softmax(logits), targets[start:start + PROMPT_LOGITS_ROWS], k)
        return entries

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits (rows, vocab) of the rows `last_index` names: each sampled sequence's last token, and
        the prompt positions of requests that want prompt logprobs."""
        return self.model.compute_logits(self.hidden(inputs))

    def hidden(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of the rows `last_index` names."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.input_rows)
        return hidden if inputs.last_index is None else hidden[inputs.last_index]

    def prepare(self, step: ScheduledStep) -> StepInputs:
        """Flat inputs of a step whose one-token chunks (decodes) come first, as the scheduler orders them."""
        chunks = step.chunks
        num_decodes = next((i for i, c in enumerate(chunks) if c.num_tokens > 1), len(chunks))
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[PromptRows] = []
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            input_ids.extend(chunk.seq.token_ids[chunk.start:end])
            positions.extend(range(chunk.start, end))
            if (wanted := _prompt_targets(chunk)) is not None:
                first, count = wanted   # position p's logits predict prompt token p + 1
                prompt_rows.append(PromptRows(chunk.seq, first, len(last_rows), count))   # type: ignore[arg-type]
                row = len(positions) - chunk.num_tokens + (first - 1 - chunk.start)   # position first - 1
                last_rows.extend(range(row, row + count))
            if chunk.samples:
                sample_rows.append(len(last_rows))
                last_rows.append(len(positions) - 1)
        decodes = self._decode_group(chunks[:num_decodes]) if num_decodes else None
        prompt_chunks = self._chunk_group(chunks[num_decodes:]) if num_decodes < len(chunks) else None
        meta = AttentionMetadata(kv_pool=self.kv_pool, slot_mapping=self._tensor(self._slots(chunks)),
                                 decodes=decodes, chunks=prompt_chunks)
        every_row = len(last_rows) == len(positions)
        return StepInputs(self._tensor(input_ids), self._tensor(positions),
                          None if every_row else self._tensor(last_rows), meta, self._input_rows(chunks),
                          None if not prompt_rows else sample_rows, prompt_rows)

    def _input_rows(self, chunks: list[ScheduledChunk]) -> InputRows | None:
        """The image rows among the step's inputs (a chunk may start or end inside an image) and their embeddings."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        offset = 0   # the chunk's first row in the flat input
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            for start, image in chunk.seq.mm:   # type: ignore[attr-defined]  # the engine schedules its requests
                lo, hi = max(start, chunk.start), min(start + image.num_positions, end)
                if lo < hi:
                    rows.extend(range(offset + lo - chunk.start, offset + hi - chunk.start))
                    parts.append(image.tensor[lo - start:hi - start])
            offset += chunk.num_tokens
        return (self._tensor(rows), torch.cat(parts).to(self.device)) if parts else None

    def _slots(self, chunks: list[ScheduledChunk]) -> list[int]:
        bs = self.block_size
        slots: list[int] = []
        for chunk in chunks:
            table = chunk.seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.start + chunk.num_tokens))
        return slots

    def _decode_group(self, chunks: list[ScheduledChunk]) -> SeqGroup:
        # The native decode loops stop at each context's end: they need no mask.
        return self._group(chunks, with_mask=not paged_decode.applies(self.kv_pool), query_index=None)

    def _chunk_group(self, chunks: list[ScheduledChunk]) -> SeqGroup:
        query_lens = [c.num_tokens for c in chunks]
        # Equal-length chunks with nothing before them need no mask, gather or padding (single prompts).
        if all(c.start == 0 for c in chunks) and len(set(query_lens)) == 1:
            return self._group(chunks, with_mask=False, query_index=None)
        max_query_len = max(query_lens)
        rows = [row * max_query_len + i for row, n in enumerate(query_lens) for i in range(n)]
        return self._group(chunks, with_mask=chunks_need_mask(self.kv_pool, len(chunks)),
                           query_index=self._tensor(rows))

    def _group(self, chunks: list[ScheduledChunk], with_mask: bool, query_index: torch.Tensor | None) -> SeqGroup:
        tables = [c.seq.block_table for c in chunks]
        max_blocks = max(len(t) for t in tables)
        context_lens = [c.start + c.num_tokens for c in chunks]
        mask = None
        if with_mask:
            query_lens = [c.num_tokens for c in chunks]
            mask = build_mask(torch.tensor(context_lens), torch.tensor(query_lens), max(query_lens),
                              max_blocks * self.block_size, self.kv_pool.dtype).to(self.device)
        return SeqGroup(block_tables=self._tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
                        context_lens=self._tensor(context_lens), max_context_len=max(context_lens),
                        mask=mask, query_index=query_index, query_lens=[c.num_tokens for c in chunks])

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def _prompt_targets(chunk: ScheduledChunk) -> tuple[int, int] | None:
    """(first prompt token, count) whose logprobs this chunk's logits give and its request still lacks."""
    seq: SequenceView = chunk.seq   # type: ignore[assignment]  # the engine schedules its requests
    recorded = seq.prompt_logprobs
    if recorded is None:
        return None
    first = max(chunk.start + 1, len(recorded))
    last = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)   # the last prompt token is predicted
    return (first, last - first + 1) if first <= last else None
