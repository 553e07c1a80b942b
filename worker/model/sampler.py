"""Turning last-position logits into next tokens, one request's parameters per row."""
from __future__ import annotations

from typing import Sequence

import torch

from worker.model.logprobs import TokenLogprobs, log_softmax, token_logprobs
from worker.model.sequence_view import SequenceView
from worker.sampling_params import SamplingParams


def sample(logits: torch.Tensor, seqs: Sequence[SequenceView],
           eos_token_ids: Sequence[int] = ()) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: (seqs, vocab) float32. The token picked for each row and, where its request asks
    for them, its logprobs (of the raw logits, whatever changed the pick).

    A structured output request's row is masked to what its grammar allows first (in place). Rows
    whose request changes its logits (penalties, logit_bias, min_tokens) or samples at random
    are processed one at a time, random ones with their own generator, so a seeded request draws
    the same tokens whatever else shares its batch.
    """
    for row, seq in enumerate(seqs):
        if seq.grammar is not None:   # before anything, as vLLM applies it: its logprobs see the mask too
            seq.grammar.mask(logits[row])
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.greedy and not p.processes_logits:
            continue
        row_logits = process_logits(logits[row], seq, eos_token_ids) if p.processes_logits else logits[row]
        if seq.grammar is not None and p.min_tokens and not torch.isfinite(row_logits).any():
            # The grammar allows only what min_tokens bans (its end): the grammar wins, as in vLLM.
            row_logits = process_logits(logits[row], seq, (), ban_stops=False)
        if p.greedy:
            tokens[row] = int(row_logits.argmax())
        else:
            tokens[row] = int(torch.multinomial(_probs(row_logits, p), 1, generator=seq.generator))
    return tokens, _logprobs(logits, seqs, tokens)


def process_logits(logits: torch.Tensor, seq: SequenceView, eos_token_ids: Sequence[int],
                   ban_stops: bool = True) -> torch.Tensor:
    """A copy of one row's logits after min_tokens, logit_bias and the penalties, in vLLM's order.

    Everything here depends on the request's own tokens only: a decode worker, whose request
    holds the prefill worker's first token as its first output, picks what one worker would.
    """
    p, out = seq.params, seq.output_token_ids
    logits = logits.clone()
    if ban_stops and len(out) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        logits[banned] = float("-inf")
    if p.logit_bias:
        logits[list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    if p.has_penalties:
        vocab = logits.shape[-1]
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=vocab)[:vocab].to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[seq.token_ids[:seq.num_prompt_tokens]] = True
            penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        logits -= p.frequency_penalty * counts
        logits -= p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest head of the distribution whose mass reaches top_p (at least one token).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def _logprobs(logits: torch.Tensor, seqs: Sequence[SequenceView], tokens: list[int]) -> list[TokenLogprobs | None]:
    found: list[TokenLogprobs | None] = [None] * len(seqs)
    for row, seq in enumerate(seqs):
        if seq.params.logprobs is not None:
            found[row] = token_logprobs(log_softmax(logits[row:row + 1]), [tokens[row]], seq.params.logprobs)[0]
    return found


def skip_sample(vocab_size: int, params: SamplingParams, generator: torch.Generator) -> None:
    """Advances `generator` exactly as one sample() of a random row would.

    A decode worker receives its first token from the prefill worker, which drew it from its
    own copy of the request's generator; drawing once here (the number of draws depends only
    on the vocabulary size, not the probabilities) leaves this copy in the state the `both`
    worker's generator has after token 1, so seeded outputs match token for token.
    """
    if not params.greedy:
        torch.multinomial(torch.ones(vocab_size), 1, generator=generator)
