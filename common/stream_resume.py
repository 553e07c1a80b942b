"""A stream that moves to another worker mid-answer: what the proxy and our worker agree on.

The proxy asks a decode leg for the ids of the tokens it streams (`TOKEN_IDS`: each chunk's choice
then carries them in `token_ids`), so that when the worker dies or drains mid-answer it can send the
request again to another worker with the tokens streamed so far (`RESUME_FROM`). That worker computes
their KV, takes them as outputs it already made (its sampler, detokenizer, stop checks, max_tokens
and usage count them as its own) and streams on from the next token. A draining worker may end its
running streams early with an in-band error of type `HANDED_BACK`, which the proxy resumes the same
way. Both keys are this project's own: a vLLM server ignores them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

TOKEN_IDS = "neuron_di_token_ids"     # body: true -> each choice (streamed or not) carries its `token_ids`
RESUME_FROM = "neuron_di_resume_from"  # body: the output token ids the answer already has
RESUME_TEXT = "neuron_di_resume_text_chars"  # body: how many characters of their text the client has
HANDED_BACK = "stream_handed_back"     # error type: a draining worker ended the stream for another to resume


def wants_token_ids(body: Mapping[str, Any]) -> bool:
    """Whether `body` asks for each streamed choice's token ids; ValueError if the key is not a bool."""
    value = body.get(TOKEN_IDS)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"`{TOKEN_IDS}` must be a boolean")
    return bool(value)


@dataclass(frozen=True)
class Resumed:
    """What an answer another worker began already has: its output token ids, and how many characters of their
    text the client got (None: all of it). A worker holds back text that may begin a stop string or is part of a
    character, so the client may have less than the tokens' text: the resuming worker shows the rest first."""

    token_ids: tuple[int, ...] = ()
    text_chars: int | None = None

    def __bool__(self) -> bool:
        return bool(self.token_ids)


def resume_from(body: Mapping[str, Any]) -> Resumed:
    """What `body` resumes from (empty: a new answer); ValueError if the keys are malformed."""
    value, chars = body.get(RESUME_FROM), body.get(RESUME_TEXT)
    if chars is not None and (not isinstance(chars, int) or isinstance(chars, bool) or chars < 0):
        raise ValueError(f"`{RESUME_TEXT}` must be a count of characters")
    if value is None:
        return Resumed()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"`{RESUME_FROM}` must be a list of token ids")
    return Resumed(tuple(value), chars)
