"""Log-probabilities of chosen tokens and the most likely alternatives, as vLLM reports them."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position's logprob of the token that stands there, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int                                # how many tokens are at least as likely, itself included (vLLM's rank)
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the most likely tokens, best first


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """One entry per row of `logprobs` (rows, vocab): row i's for token_ids[i], with `num_top`
    alternatives (-1: the whole vocabulary)."""
    if not token_ids:
        return []
    k = logprobs.shape[-1] if num_top == -1 else min(num_top, logprobs.shape[-1])
    ids = torch.tensor(token_ids, dtype=torch.int64).unsqueeze(-1)
    chosen = logprobs.gather(-1, ids)
    ranks = (logprobs >= chosen).sum(-1).tolist()
    top_values, top_ids = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0], ids[:, :0])
    rows = zip(token_ids, chosen.squeeze(-1).tolist(), ranks, top_ids.tolist(), top_values.tolist())
    return [TokenLogprobs(t, lp, rank, tuple(zip(tids, values))) for t, lp, rank, tids, values in rows]
