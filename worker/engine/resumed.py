"""A request that resumes an answer another worker began: its first outputs are given, not sampled.

The given tokens become the request's outputs as if this engine had sampled them, so that what it
samples next is what one uninterrupted run would sample: their KV is computed with the prompt's (as
for a preempted request), the generator draws once per token (a seeded request's draws depend only on
the seed and the number of tokens before, see `skip_sample`), the detokenizer and the grammar move past
them, and max_tokens, min_tokens, penalties and usage count them.
"""
from __future__ import annotations

from typing import Sequence

from common.stream_resume import RESUME_FROM, Resumed
from worker.engine.request import Request
from worker.errors import invalid
from worker.model.sampler import skip_sample


def take_resumed(request: Request, resumed: Resumed, vocab_size: int) -> None:
    """Makes `resumed` the outputs of `request`, which has none yet; the text the client has of them was handed
    out already, the rest (held back by the worker that began the answer) comes with the next token's."""
    assert request.num_output_tokens == 0
    for token_id in resumed.token_ids:
        request.token_ids.append(token_id)
        skip_sample(vocab_size, request.params, request.generator)
        request.advance(token_id)
        request.detokenizer.step(request.output_token_ids, False)
    if resumed.text_chars is not None:
        request.detokenizer.num_emitted = min(resumed.text_chars, request.detokenizer.num_emitted)


def check_resumed(resumed: Sequence[int], max_tokens: int, vocab_size: int, is_leg: bool) -> None:
    """InvalidRequestError unless `resumed` fits: fewer than max_tokens ids of the vocabulary, on a whole
    request or a decode leg (which pulls their KV from the worker that began the answer)."""
    if not resumed:
        return
    if is_leg:
        raise invalid("a resumed answer is a whole request or a decode leg, not a prefill leg", RESUME_FROM)
    if len(resumed) >= max_tokens:
        raise invalid(f"{len(resumed)} resumed tokens leave nothing of max_tokens {max_tokens} to generate",
                      RESUME_FROM)
    if not all(0 <= t < vocab_size for t in resumed):
        raise invalid(f"resumed token ids must be in [0, {vocab_size})", RESUME_FROM)
