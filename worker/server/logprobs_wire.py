"""Logprobs in vLLM's response shapes, sans I/O.

    completions   {"text_offset": [...], "token_logprobs": [...], "tokens": [...], "top_logprobs": [...]}
    chat          {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    prompt        [null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]   (vLLM's own field)

Each position lists the token that stands there first, then the top alternatives, one entry per
token id; completions key them by their text, so alternatives that read alike keep the last value.
A position without an entry (the prompt's first token; a decode leg's first token, which the
prefill worker sampled) shows the token with a null logprob (chat: -9999.0 and no alternatives);
the prompt's first token shows its own decoding, as vLLM shows it, a decode leg's first token the
text a real entry would show, so the text offsets after it are one worker's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from worker.model.logprobs import TokenLogprobs
from worker.server.token_text import MAX_CONTEXT, TokenText

FLOOR = -9999.0   # what -inf is shown as (JSON has no infinity)


@dataclass(frozen=True, slots=True)
class Position:
    """One token of a text with its logprobs entry, if any, and the tokens before it (for its text)."""

    token_id: int
    entry: TokenLogprobs | None
    context: tuple[int, ...]
    raw_text: bool = False   # shows its own decoding (the prompt's first token)


def positions(token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
              before: Sequence[int] = ()) -> list[Position]:
    """The positions of `token_ids`, read after the tokens `before` (those of the same list earlier on)."""
    seen = list(before)
    out = []
    for token_id, entry in zip(token_ids, entries):
        out.append(Position(token_id, entry, tuple(seen[-MAX_CONTEXT:])))
        seen.append(token_id)
    return out


def _ranked(entry: TokenLogprobs) -> dict[int, tuple[float, int]]:
    """token id -> (logprob, rank): the token itself first, then the alternatives (rank 1, 2, ...)."""
    found = {entry.token_id: (entry.logprob, entry.rank)}
    found.update((tid, (lp, rank)) for rank, (tid, lp) in enumerate(entry.top, 1))
    return found


def completion_logprobs(items: Sequence[Position], strings: TokenText, num_top: int,
                        text_offset: int = 0) -> dict[str, Any]:
    """The completions `logprobs` object of `items`; the first token's text starts at `text_offset`."""
    offsets, logprobs, tokens, tops = [], [], [], []
    for p in items:
        offsets.append(text_offset)
        if p.entry is None:
            token = _text(p, strings)
            logprobs.append(None)
            tops.append(None)
        else:
            token = strings.shown(p.token_id, p.context)
            logprobs.append(max(p.entry.logprob, FLOOR))
            ranked = list(_ranked(p.entry).items())
            tops.append({strings.shown(tid, p.context): max(lp, FLOOR)
                         for i, (tid, (lp, _)) in enumerate(ranked) if num_top == -1 or i <= num_top})
        tokens.append(token)
        text_offset += len(token)
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(items: Sequence[Position], strings: TokenText, num_top: int) -> dict[str, Any]:
    """The chat `logprobs` object of `items`; each lists its first `num_top` entries as alternatives."""
    content = []
    for p in items:
        if p.entry is None:
            token = _text(p, strings)
            content.append({"token": token, "logprob": FLOOR, "bytes": _bytes(token), "top_logprobs": []})
            continue
        token = strings.shown(p.token_id, p.context)
        top = [{"token": (t := strings.shown(tid, p.context)), "logprob": max(lp, FLOOR), "bytes": _bytes(t)}
               for i, (tid, (lp, _)) in enumerate(_ranked(p.entry).items()) if num_top == -1 or i < num_top]
        content.append({"token": token, "logprob": max(p.entry.logprob, FLOOR), "bytes": _bytes(token),
                        "top_logprobs": top})
    return {"content": content}


def prompt_logprobs(items: Sequence[Position], strings: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token, null or {token id: logprob, rank, decoded_token}."""
    return [None if p.entry is None else
            {str(tid): {"logprob": max(lp, FLOOR), "rank": rank, "decoded_token": strings.shown(tid, p.context)}
             for tid, (lp, rank) in _ranked(p.entry).items()}
            for p in items]


def _text(p: Position, strings: TokenText) -> str:
    return strings.raw(p.token_id) if p.raw_text else strings.shown(p.token_id, p.context)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
