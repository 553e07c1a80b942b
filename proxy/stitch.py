"""Stitching the two legs into the one answer a single server would give (sans-I/O).

The decode worker repeats the prefill worker's token as its own first token, so the client gets
prefill's token first (early), then decode's tokens after it. The client's text is decode's
text, of which prefill's token already stood for the first characters: each decode chunk passes
on only the part of decode's text the client lacks (a worker holding text back, say while a stop
string may be forming, sends it later, and nothing is doubled). With stop strings prefill's token
goes out without its text, which decode's text brings when a single server would show it. The first decode chunk also loses
the first token's logprobs entry and token id: prefill's went out in their place. That repeat
is checked too: a vLLM decode worker samples it again from the KV it received, so a different
token means the KV did not arrive intact.
"""
from __future__ import annotations

import json
from typing import Any

from common.handoff import KV_TRANSFER_PARAMS
from common.openai_wire import DONE, DONE_EVENT, sse_event
from proxy.errors import UpstreamError, UpstreamProtocol, UpstreamUnavailable
from proxy.logprobs import num_entries, with_first_entry, without_first_entry
from proxy.requests import ClientRequest

# Fields of prefill's answer that a streamed chunk carries too (vLLM's extensions): per choice, and at the
# top of a chat stream's first chunk.
_CHUNK_CHOICE_FIELDS = {False: ("stop_reason", "prompt_token_ids", "token_ids"), True: ("token_ids",)}
_ROLE_CHUNK_FIELDS = ("prompt_token_ids", "prompt_text")


def summed_usage(prefill: dict[str, Any] | None, decode: dict[str, Any] | None) -> dict[str, Any] | None:
    """Usage of the stitched answer: decode's count repeats prefill's token once; decode's other fields
    (e.g. `completion_tokens_details`) are kept as decode gave them."""
    if not prefill or not decode:
        return decode or prefill
    prompt = int(decode.get("prompt_tokens", prefill.get("prompt_tokens", 0)))
    completion = int(prefill.get("completion_tokens", 0)) + int(decode.get("completion_tokens", 0)) - 1
    return {**decode, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def prefill_finished(prefill: dict[str, Any]) -> bool:
    """True when prefill's one token already ended the answer (EOS or a stop string)."""
    return _first_choice(prefill).get("finish_reason") == "stop"


def prefill_answer(response_id: str, prefill: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer when prefill's token ended it; where its KV lies is not the client's business."""
    return {**{k: v for k, v in prefill.items() if k != KV_TRANSFER_PARAMS}, "id": response_id}


def merge_bodies(response_id: str, prefill: dict[str, Any], decode: dict[str, Any],
                 prefill_token: bool = True) -> dict[str, Any]:
    """The non-streamed answer: decode's body holds every token, prefill's included; the first token's
    logprobs entry is prefill's (without `prefill_token`, prefill's token is not the answer's: decode's is)."""
    merged = {**decode, "id": response_id, "usage": summed_usage(prefill.get("usage"), decode.get("usage"))}
    if not prefill_token:
        return merged
    first, choices = _first_choice(prefill), decode.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict) and choices[0].get("logprobs"):
        lead = {**choices[0], "logprobs": with_first_entry(choices[0]["logprobs"], first.get("logprobs"))}
        merged["choices"] = [lead, *choices[1:]]
    return merged


def first_token_repeated(prefill: dict[str, Any], decode: dict[str, Any]) -> bool | None:
    """Non-streamed: decode's text starts with prefill's token; None when it is shorter than that token (a stop
    string ended it before it showed the token), which tells nothing."""
    first, text = _text(_first_choice(prefill)), _text(_first_choice(decode, "decode"))
    return text.startswith(first) if len(text) >= len(first) else None


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
        self._include_usage = request.include_usage
        self._continuous_usage = request.continuous_usage
        self._head = {"id": response_id, "object": request.endpoint.chunk_object, "created": created,
                      "model": prefill.get("model") or request.model}
        self._prefill = prefill
        self.prefill_token = prefill_token
        self._first_text = _text(_first_choice(prefill)) if prefill_token else ""
        # With stop strings a server holds text back that may turn out to be a stop string's start (and then
        # never shows it): prefill's token's text waits for decode's text, which shows it when a server would.
        self._shown = "" if request.body.get("stop") else self._first_text
        self._decode_len = 0                    # the length of decode's text so far
        self._decode_head = ""                  # its start, until it is as long as prefill's token
        self._sent = len(self._shown)           # how much of it the client has (prefill's token stood for it)
        self._seam_open = prefill_token         # decode's repeat of prefill's token not seen yet
        self._first_token_matched: bool | None = None
        self._finished = False
        self._tokens = 1 if prefill_token else 0
        self._decode_usage: dict[str, Any] | None = None
        self._usage_chunk: dict[str, Any] | None = None
        self.moves = 0                          # times the answer moved to another decode worker

    def first(self) -> list[bytes]:
        """Prefill's token as the first chunk; the whole stream if that token ended it."""
        choice = _first_choice(self._prefill)
        if not self.prefill_token:
            return []
        events = []
        if self._chat:
            # Like a single server: a role-only chunk first, then one chunk per token.
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            top = {k: self._prefill[k] for k in _ROLE_CHUNK_FIELDS if k in self._prefill}
            events.append(sse_event({**self._head, "choices": [role], **top, **self._running_usage(0)}))
        finished = prefill_finished(self._prefill)
        text = self._first_text if finished else self._shown
        body = {"delta": {"content": text}} if self._chat else {"text": text}
        out = {"index": 0, **body, "logprobs": choice.get("logprobs"),
               "finish_reason": choice.get("finish_reason") if finished else None}
        fields = _CHUNK_CHOICE_FIELDS[self._chat] + (("stop_reason",) if finished and self._chat else ())
        out.update({k: choice[k] for k in fields if k in choice})
        chunk = {**self._head, "choices": [out], **self._running_usage(1)}
        if finished and not self._include_usage and self._prefill.get("system_fingerprint") is not None:
            chunk["system_fingerprint"] = self._prefill["system_fingerprint"]
        events.append(sse_event(chunk))
        if finished:
            self._finished = True
            usage = {k: v for k, v in (self._prefill.get("usage") or {}).items() if v is not None}
            fingerprint = self._prefill.get("system_fingerprint")
            events += self._closing({**self._head, "choices": [], "usage": usage,
                                     **({"system_fingerprint": fingerprint} if fingerprint is not None else {})})
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
        if not choices and chunk.get("usage"):
            self._usage_chunk = chunk
        ours = {"id": self._head["id"], "created": self._head["created"]}
        return [sse_event({**chunk, **ours, "choices": [out]}) for choice in choices
                if (out := self._choice(choice)) is not None]

    def close(self) -> list[bytes]:
        """Decode's stream ended: the usage chunk if asked for, then [DONE]."""
        if not self._finished:
            raise UpstreamUnavailable("stream ended before the answer finished", "decode")
        usage = summed_usage(self._prefill.get("usage"), self._decode_usage)
        if usage is None:
            prompt = int((self._prefill.get("usage") or {}).get("prompt_tokens", 0))
            usage = {"prompt_tokens": prompt, "completion_tokens": self._tokens,
                     "total_tokens": prompt + self._tokens}
        ours = {"id": self._head["id"], "created": self._head["created"]}
        if self.moves:  # says the stream moved (proxy/stream_moves.py)
            usage = {**usage, "stream_moves": self.moves}
        return self._closing({**self._head, "choices": [], **(self._usage_chunk or {}), **ours, "usage": usage})

    def resumed(self) -> int:
        """Decode's stream goes on on another worker, which does not repeat prefill's token and shows the answer's
        text from where the client's ends: how many characters of it the client has."""
        self._seam_open = False
        self._decode_len = self._sent   # what the next leg shows starts there
        self.moves += 1
        return self._sent

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def first_token_matched(self) -> bool | None:
        """Whether decode's first token equals prefill's; None until decode has sent it."""
        return self._first_token_matched

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """Decode's choice as the client gets it; None for one that brings the client nothing."""
        finish = choice.get("finish_reason")
        if self._chat and "role" in (choice.get("delta") or {}) and not _text(choice) and finish is None:
            if self._seam_open:
                return None  # the role chunk was already sent before prefill's token
            return {**choice, "index": 0}  # decode's own role chunk: prefill's token is not the answer's
        text = self._advance(_text(choice))
        if self._seam_open:
            self._seam_open = False
            choice = _without_first_token(choice)  # decode's repeat of prefill's token
            if not text and finish is None and not _carries_tokens(choice):
                return None
        else:
            self._tokens += 1
        if finish is not None:
            if self._finished:
                raise UpstreamProtocol("stream finished twice", "decode")
            self._finished = True
        return _with_text({**choice, "index": 0}, text, self._chat)

    def _advance(self, text: str) -> str:
        """Decode's text grows by `text`: the part of it the client has not had yet."""
        start, self._decode_len = self._decode_len, self._decode_len + len(text)
        if self.prefill_token and self._first_token_matched is None and not self.moves:  # as far as prefill's token
            self._decode_head += text
            if len(self._decode_head) >= len(self._first_text):
                self._first_token_matched = self._decode_head.startswith(self._first_text)
        new = text[max(0, self._sent - start):]
        self._sent = max(self._sent, self._decode_len)
        return new

    def _running_usage(self, completion_tokens: int) -> dict[str, Any]:
        """`stream_options.continuous_usage_stats`: the usage so far, on each chunk the proxy makes itself."""
        if not self._continuous_usage:
            return {}
        prompt = int((self._prefill.get("usage") or {}).get("prompt_tokens", 0))
        return {"usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                          "completion_tokens": completion_tokens}}

    def _closing(self, usage_chunk: dict[str, Any]) -> list[bytes]:
        return ([sse_event(usage_chunk)] if self._include_usage else []) + [DONE_EVENT]


def _without_first_token(choice: dict[str, Any]) -> dict[str, Any]:
    out = dict(choice)
    if out.get("logprobs"):
        out["logprobs"] = without_first_entry(out["logprobs"])
    if isinstance(out.get("token_ids"), list):
        out["token_ids"] = out["token_ids"][1:]
    if out.get("prompt_token_ids") is not None:
        out["prompt_token_ids"] = None  # sent with prefill's token
    return out


def _carries_tokens(choice: dict[str, Any]) -> bool:
    return num_entries(choice.get("logprobs")) > 0 or bool(choice.get("token_ids"))


def _with_text(choice: dict[str, Any], text: str, chat: bool) -> dict[str, Any]:
    if not chat:
        return {**choice, "text": text}
    delta = dict(choice.get("delta") or {})
    if "content" in delta or text:
        delta["content"] = text
    return {**choice, "delta": delta}
