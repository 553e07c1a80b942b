"""The text a logprobs entry shows for one token, as vLLM shows it.

A token decodes alone, special tokens included (`<|eos|>`); a SentencePiece piece keeps the
leading spaces its markers stand for. A token that ends in part of a UTF-8 character (U+FFFD
alone) is read with up to four tokens before it: it shows the characters it completes, or ""
while the character is still incomplete.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Protocol, Sequence

from common.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
MAX_CONTEXT = 4   # a UTF-8 character spans at most four tokens
TOKEN_ID_PREFIX = "token_id:"


class TokenText(Protocol):
    def raw(self, token_id: int) -> str: ...

    def shown(self, token_id: int, context: Sequence[int]) -> str: ...


class TokenStrings:
    """Token texts of one tokenizer; `shown(token, context)` is what a logprobs entry names."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._inner = tokenizer.inner
        self._marker = _space_marker(tokenizer.inner.to_str())
        self.raw = lru_cache(maxsize=65536)(self._raw)

    def _raw(self, token_id: int) -> str:
        text = self._inner.decode([token_id], skip_special_tokens=False)
        if self._marker is None:
            return text
        piece = self._inner.id_to_token(token_id) or ""
        markers = len(piece) - len(piece.lstrip(self._marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def as_ids(self) -> TokenIds:
        return TokenIds(self)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._inner.decode(list(token_ids), skip_special_tokens=False)

    def shown(self, token_id: int, context: Sequence[int]) -> str:
        """The token's text after the tokens `context` (the sequence's previous tokens, oldest first)."""
        text = self.raw(token_id)
        return text if not text.endswith(REPLACEMENT_CHAR) else self._completed(token_id, list(context[-MAX_CONTEXT:]))

    def _completed(self, token_id: int, context: list[int]) -> str:
        """What `token_id` adds to the text once the tokens before it (the fewest that make a whole
        character) are read with it; "" if no such reading ends in whole characters."""
        for n in range(1, len(context) + 1):
            before = context[-n:]
            full = self.decode(before + [token_id])
            if full.endswith(REPLACEMENT_CHAR):
                continue
            # Context tokens that are themselves partial characters showed ""; their text is this token's.
            whole = len(before)
            while whole > 0 and self.raw(before[whole - 1]).endswith(REPLACEMENT_CHAR):
                whole -= 1
            prefix = self.decode(before[:whole]) if whole else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            return full[common:]
        return ""


def _space_marker(tokenizer_json: str) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style tokenizer, else None."""
    pre = (json.loads(tokenizer_json).get("pre_tokenizer") or {})
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return next((s.get("replacement", "\u2581") for s in steps if s.get("type") == "Metaspace"), None)


class TokenIds:
    """Token texts as `return_tokens_as_token_ids` asks: "token_id:<id>", a name no two tokens share."""

    def __init__(self, strings: TokenStrings) -> None:
        self.decode = strings.decode

    def raw(self, token_id: int) -> str:
        return f"{TOKEN_ID_PREFIX}{token_id}"

    def shown(self, token_id: int, context: Sequence[int]) -> str:
        return self.raw(token_id)


def parse_token_id(text: str) -> int | None:
    """The id in a "token_id:<id>" name, else None."""
    head, _, tail = text.partition(":")
    return int(tail) if f"{head}:" == TOKEN_ID_PREFIX and tail.isdigit() else None
