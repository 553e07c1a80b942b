"""Response bodies in vLLM's shapes, sans I/O: whole answers, stream chunks and usage.

Keys are vLLM's, null where this server has nothing to say (`system_fingerprint`, `token_ids`,
`routed_experts`, ...); stream chunks leave out what vLLM leaves out of them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from common.openai_wire import CHAT_ID_PREFIX, COMPLETION_ID_PREFIX

Kind = Literal["completion", "chat"]
_CHAT_MESSAGE_EXTRAS = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None}


@dataclass(frozen=True)
class ChoiceBody:
    """What one choice says in a whole answer or one chunk."""

    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[Any] | None = None   # completions, whole answers: vLLM's per-choice field
    prompt_token_ids: list[int] | None = None  # completions, the stream chunk that echoes the prompt
    token_ids: list[int] | None = None         # when asked for (common/stream_resume.py)


def usage(num_prompt_tokens: int, num_output_tokens: int, details: bool = True) -> dict[str, Any]:
    """vLLM's usage object; a stream's final usage chunk has no `*_details` keys."""
    body: dict[str, Any] = {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens + num_output_tokens,
                            "completion_tokens": num_output_tokens}
    if details:
        body.update(prompt_tokens_details=None, completion_tokens_details=None)
    return body


def continuous_usage(kind: Kind, num_prompt_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    """The usage on every chunk with stream_options.continuous_usage_stats (chat names no prompt details)."""
    body = usage(num_prompt_tokens, num_output_tokens, details=False)
    if kind == "chat":
        body["completion_tokens_details"] = None
    return body


@dataclass(frozen=True)
class ResponseShape:
    """What every body of one response shares: its id, model and creation time."""

    kind: Kind
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"{CHAT_ID_PREFIX if self.kind == 'chat' else COMPLETION_ID_PREFIX}{self.request_id}"

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, choices: list[ChoiceBody], usage_body: dict[str, Any],
             prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
        """The one JSON body of a non-streamed response (chat's prompt logprobs are top-level)."""
        body = self._envelope(self.object, [self._full_choice(c) for c in choices])
        body.update(service_tier=None, system_fingerprint=None, usage=usage_body)
        if self.kind == "chat":
            body.update(prompt_logprobs=prompt_logprobs, prompt_token_ids=None, prompt_text=None)
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return body

    def _full_choice(self, c: ChoiceBody) -> dict[str, Any]:
        if self.kind == "chat":
            return {"index": c.index, "message": {"role": "assistant", "content": c.text, **_CHAT_MESSAGE_EXTRAS},
                    "logprobs": c.logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids, "routed_experts": None}
        return {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, "token_ids": c.token_ids, "prompt_logprobs": c.prompt_logprobs,
                "prompt_token_ids": None, "routed_experts": None}

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat: the first chunk of each choice, naming the assistant's role."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self._envelope(self.chunk_object, [choice]), "prompt_token_ids": None, "prompt_text": None}

    def chunk(self, c: ChoiceBody) -> dict[str, Any]:
        """One streamed chunk of one choice; `stop_reason` comes with a finish_reason."""
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": c.index, "delta": {"content": c.text}, "logprobs": c.logprobs,
                                      "finish_reason": c.finish_reason}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            choice["token_ids"] = c.token_ids
        else:
            choice = {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason, "prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids}
        return self._envelope(self.chunk_object, [choice])

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        """The final chunk of a stream with stream_options.include_usage: no choices, only usage."""
        return {**self._envelope(self.chunk_object, []), "usage": usage_body}
