"""Logprobs at the seam between the two legs (sans-I/O).

A choice's `logprobs` holds one entry per token: completions as parallel lists (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`), chat as a list under `content`. The prefill
worker computed the first token's entry from the whole prompt, as one server does; the decode
worker computed its own entry for that token again from the moved KV (vLLM recomputes the
prompt's last position), so the stitched answer takes entry 0 from prefill and the rest from
decode. Text offsets stay decode's: its text is the whole answer's, the first token included.
"""
from __future__ import annotations

from typing import Any

_COMPLETION_LISTS = ("tokens", "token_logprobs", "top_logprobs")
_ALL_COMPLETION_LISTS = _COMPLETION_LISTS + ("text_offset",)


def with_first_entry(decode: Any, prefill: Any) -> Any:
    """Decode's logprobs of a whole answer with the first token's entry taken from prefill's."""
    if not isinstance(decode, dict) or not isinstance(prefill, dict):
        return decode
    if "content" in decode:
        ours, theirs = decode.get("content"), prefill.get("content")
        if not _non_empty_lists(ours, theirs):
            return decode
        return {**decode, "content": [theirs[0], *ours[1:]]}
    merged = dict(decode)
    for key in _COMPLETION_LISTS:
        ours, theirs = decode.get(key), prefill.get(key)
        if _non_empty_lists(ours, theirs):
            merged[key] = [theirs[0], *ours[1:]]
    return merged


def without_first_entry(logprobs: Any) -> Any:
    """A streamed chunk's logprobs without the first token's entry (prefill's was sent in its place)."""
    if not isinstance(logprobs, dict):
        return logprobs
    if "content" in logprobs:
        content = logprobs.get("content")
        return {**logprobs, "content": content[1:]} if isinstance(content, list) else logprobs
    return {**logprobs, **{key: value[1:] for key in _ALL_COMPLETION_LISTS
                           if isinstance(value := logprobs.get(key), list)}}


def num_entries(logprobs: Any) -> int:
    """How many tokens a logprobs object has entries for (0 for none)."""
    if not isinstance(logprobs, dict):
        return 0
    entries = logprobs.get("content") if "content" in logprobs else logprobs.get("tokens")
    return len(entries) if isinstance(entries, list) else 0


def _non_empty_lists(*values: Any) -> bool:
    return all(isinstance(v, list) and v for v in values)
