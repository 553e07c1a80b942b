"""The tokenizer of a model directory: `tokenizer.json` plus the chat template, if any.

Shared by the worker (which generates with it) and the proxy (which counts prompt tokens with it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from common.byte_tokenizer import BOS_ID, BOS_TOKEN, CHAT_TEMPLATE, EOS_ID, EOS_TOKEN, build_byte_tokenizer
from common.errors import ChatTemplateError, TokenizerLoadError

# Used when a checkpoint ships no chat template: plain "role: content" lines.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class Tokenizer:
    """Encodes prompts, decodes outputs and renders chat messages into a prompt."""

    def __init__(self, inner: HFTokenizer, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None) -> None:
        self.inner = inner
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template or FALLBACK_CHAT_TEMPLATE
        self.special_tokens = special_tokens or {}
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(self.chat_template)
        # Every token stands for at most this many characters of text (its vocabulary entry's).
        self._max_token_chars = max(map(len, inner.get_vocab(with_added_tokens=True)), default=1)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size()

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` can encode to, known without encoding it (which takes seconds
        for megabytes of text)."""
        return -(-len(text) // self._max_token_chars)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.inner.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_with_specials(self, text: str) -> list[int]:
        """`text` with the special tokens the tokenizer's own post-processor adds (a BOS or none): how a
        Hugging Face tokenizer, and so `vllm serve`, encodes a completion prompt."""
        return self.inner.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; its BOS (if the template adds one) is in the text."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ChatTemplateError("messages must be a list of objects with a 'role'")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"cannot render the chat template: {exc}") from exc

    @classmethod
    def from_dir(cls, path: str | Path, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """The tokenizer in `path`; `tokenizer_config.json`'s special tokens win over the ids given
        (the model config's), its EOS joins theirs. TokenizerLoadError if the files are not usable."""
        path = Path(path)
        try:
            inner = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise TokenizerLoadError(f"cannot load {path / 'tokenizer.json'}: {exc}") from exc
        extra = _read_json(path / "tokenizer_config.json")
        specials = {name: _token_text(extra.get(name)) for name in ("bos_token", "eos_token")}
        specials = {name: text for name, text in specials.items() if text}
        bos = inner.token_to_id(specials["bos_token"]) if "bos_token" in specials else bos_token_id
        eos = list(eos_token_ids)
        eos_from_config = inner.token_to_id(specials.get("eos_token", ""))
        if eos_from_config is not None and eos_from_config not in eos:
            eos.append(eos_from_config)
        template = extra.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(inner, bos, eos, template, specials)

    @classmethod
    def builtin(cls) -> Tokenizer:
        """The built-in model's byte-level tokenizer, as its model directory holds it."""
        return cls(build_byte_tokenizer(), BOS_ID, [EOS_ID], CHAT_TEMPLATE,
                   {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN})

def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise TokenizerLoadError(f"malformed {path}: {exc}") from exc


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens either as strings or as {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)
