"""Structured output: the tokens a request's grammar allows next, as a mask on its logits (llguidance).

A grammar is llguidance's serialized form (from a JSON schema, a regex or a choice; see
worker/server/structured_wire.py). Each request gets its own matcher, advanced by every token of
its output: on a decode worker the prefill worker's first token too, so the constraint goes on
from where one worker would be.
"""
from __future__ import annotations

import llguidance
import torch

from common.tokenizer import Tokenizer
from worker.errors import invalid


class GrammarCompiler:
    """Builds matchers over one tokenizer (its vocabulary read once, on first use)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def matcher(self, grammar: str, param: str) -> Grammar:
        """A fresh matcher of `grammar`; a grammar llguidance refuses is an invalid request naming `param`."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.inner.to_str(), n_vocab=self._vocab_size,
                                                        eos_token=list(self._tokenizer.eos_token_ids) or None, slices=[])
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise invalid(f"the structured output constraint cannot be compiled: {matcher.get_error()}", param)
        return Grammar(matcher)


class Grammar:
    """One request's place in its grammar."""

    _BITS = torch.arange(8, dtype=torch.uint8)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def mask(self, logits: torch.Tensor) -> None:
        """Sets the logits (one row, in place) of every token the grammar does not allow next to -inf."""
        if self._matcher.is_error():   # see accept(): nothing left to constrain
            return
        packed = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((packed.unsqueeze(-1) >> self._BITS) & 1).flatten().bool()   # bit i of the mask: token i
        vocab = logits.shape[-1]
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[:min(vocab, allowed.numel())] = allowed[:vocab]
        logits.masked_fill_(~keep, float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advances past `token_id`. A token the grammar refuses (only a prefill peer that ignored the grammar
        sends one) ends the constraint: the output already broke it."""
        self._matcher.consume_token(token_id)
