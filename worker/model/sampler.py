"""Turning last-position logits into next tokens, one request's parameters per row."""
from __future__ import annotations

import torch

from worker.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits: (seqs, vocab) float32. Greedy rows take the argmax.

    Random rows are processed one at a time with their own generator so a seeded request
    draws the same tokens whatever else shares its batch.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = _probs(logits[row], p)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator))
    return tokens


def _probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
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


def skip_sample(vocab_size: int, params: SamplingParams, generator: torch.Generator) -> None:
    """Advances `generator` exactly as one sample() of a random row would.

    A decode worker receives its first token from the prefill worker, which drew it from its
    own copy of the request's generator; drawing once here (the number of draws depends only
    on the vocabulary size, not the probabilities) leaves this copy in the state the `both`
    worker's generator has after token 1, so seeded outputs match token for token.
    """
    if not params.greedy:
        torch.multinomial(torch.ones(vocab_size), 1, generator=generator)
