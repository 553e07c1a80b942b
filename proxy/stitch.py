"""Stitching the two legs into the one answer a single server would give (sans-I/O).

The decode worker repeats the prefill worker's token as its own first token, so the
client gets prefill's token first (early), then decode's tokens without that repeat. That
repeat is also checked: a vLLM decode worker samples it again from the KV it received, so a
different token means the KV did not arrive intact.
"""
from __future__ import annotations

import json
from typing import Any

from common.openai_wire import DONE, DONE_EVENT, sse_event
from proxy.errors import UpstreamError, UpstreamProtocol, UpstreamUnavailable
from proxy.requests import ClientRequest


def summed_usage(prefill: dict[str, Any] | None, decode: dict[str, Any] | None) -> dict[str, int] | None:
    """Usage of the stitched answer: decode's count repeats prefill's token once."""
    if not prefill or not decode:
        return decode or prefill
    prompt = int(decode.get("prompt_tokens", prefill.get("prompt_tokens", 0)))
    completion = int(prefill.get("completion_tokens", 0)) + int(decode.get("completion_tokens", 0)) - 1
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def prefill_finished(prefill: dict[str, Any]) -> bool:
    """True when prefill's one token already ended the answer (EOS or a stop string)."""
    return _first_choice(prefill).get("finish_reason") == "stop"


def prefill_answer(response_id: str, prefill: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer when prefill's token ended it; where its KV lies is not the client's business."""
    return {**{k: v for k, v in prefill.items() if k != "kv_transfer_params"}, "id": response_id}


def merge_bodies(response_id: str, prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer: decode's body already holds every token, prefill's included."""
    return {**decode, "id": response_id, "usage": summed_usage(prefill.get("usage"), decode.get("usage"))}


def first_token_repeated(prefill: dict[str, Any], decode: dict[str, Any]) -> bool:
    """Non-streamed: decode's text starts with prefill's token."""
    return _text(_first_choice(decode, "decode")).startswith(_text(_first_choice(prefill)))


def _first_choice(body: dict[str, Any], role: str = "prefill") -> dict[str, Any]:
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamProtocol("answer has no choices", role)
    return choices[0]


def _text(choice: dict[str, Any]) -> str:
    """A choice's text: `text` (completions), `message` or `delta` content (chat)."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


class StreamStitcher:
    """Builds the client's SSE events from prefill's JSON answer and decode's SSE payloads. Without
    `prefill_token`, prefill's token is not the answer's: every token, the first included, is decode's."""

    def __init__(self, request: ClientRequest, response_id: str, created: int, prefill: dict[str, Any],
                 prefill_token: bool = True) -> None:
        self._chat = request.endpoint.is_chat
        self._object = request.endpoint.chunk_object
        self._include_usage = request.include_usage
        self._head = {"id": response_id, "object": self._object, "created": created,
                      "model": prefill.get("model") or request.model}
        self._prefill = prefill
        self.prefill_token = prefill_token
        self._skipped = not prefill_token    # decode's repeat of prefill's token is skipped
        self._first_token_matched: bool | None = None
        self._finished = False
        self._tokens = 1 if prefill_token else 0
        self._decode_usage: dict[str, Any] | None = None

    def first(self) -> list[bytes]:
        """Prefill's token as the first chunk; the whole stream if that token ended it."""
        choice = _first_choice(self._prefill)
        if not self.prefill_token:
            return []
        events = []
        if self._chat:
            # Like a single server: a role-only chunk first, then one chunk per token.
            events.append(self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}))
            body = {"delta": {"content": _text(choice)}}
        else:
            body = {"text": _text(choice)}
        finish = choice.get("finish_reason") if prefill_finished(self._prefill) else None
        events.append(self._chunk({"index": 0, **body, "logprobs": choice.get("logprobs"), "finish_reason": finish}))
        if finish is not None:
            self._finished = True
            events += self._closing(self._prefill.get("usage"))
        return events

    def feed(self, data: str) -> list[bytes]:
        """One decode SSE payload in, zero or more client events out."""
        if data == DONE:
            return []
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise UpstreamProtocol(f"bad SSE payload {data[:80]!r}", "decode") from exc
        if not isinstance(chunk, dict):
            raise UpstreamProtocol(f"bad SSE payload {data[:80]!r}", "decode")
        if "error" in chunk:
            raise UpstreamError(f"stream error: {json.dumps(chunk['error'])[:300]}", "decode")
        if chunk.get("usage"):
            self._decode_usage = chunk["usage"]
        choices = chunk.get("choices") or []
        return [event for choice in choices if (event := self._choice(choice)) is not None]

    def close(self) -> list[bytes]:
        """Decode's stream ended: the usage chunk if asked for, then [DONE]."""
        if not self._finished:
            raise UpstreamUnavailable("stream ended before the answer finished", "decode")
        usage = summed_usage(self._prefill.get("usage"), self._decode_usage)
        if usage is None:
            prompt = int((self._prefill.get("usage") or {}).get("prompt_tokens", 0))
            usage = {"prompt_tokens": prompt, "completion_tokens": self._tokens,
                     "total_tokens": prompt + self._tokens}
        return self._closing(usage)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def first_token_matched(self) -> bool | None:
        """Whether decode's first token equals prefill's; None until decode has sent it."""
        return self._first_token_matched

    def _choice(self, choice: dict[str, Any]) -> bytes | None:
        finish = choice.get("finish_reason")
        if not self._skipped:
            if self._chat and _header_only(choice) and finish is None:
                return None  # the role chunk was already sent before prefill's token
            self._skipped = True  # decode's repeat of prefill's token
            self._first_token_matched = _text(choice) == _text(_first_choice(self._prefill))
            if finish is None:
                return None
            choice = {**choice, "text": ""} if not self._chat else {**choice, "delta": {}}
        elif not (self._chat and _header_only(choice) and finish is None):
            self._tokens += 1
        if finish is not None:
            if self._finished:
                raise UpstreamProtocol("stream finished twice", "decode")
            self._finished = True
        return self._chunk({**choice, "index": 0})

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return sse_event({**self._head, "choices": [choice]})

    def _closing(self, usage: dict[str, Any] | None) -> list[bytes]:
        events = [sse_event({**self._head, "choices": [], "usage": usage})] if self._include_usage else []
        return events + [DONE_EVENT]


def _header_only(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return "content" not in delta or ("role" in delta and not delta.get("content"))
