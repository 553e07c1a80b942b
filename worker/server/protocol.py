"""The OpenAI wire format, sans I/O: request bodies in, validated requests out; outputs in, JSON and SSE out.

Nothing here touches sockets, the event loop or the engine, so every rule is testable with plain dicts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from werkzeug.exceptions import HTTPException

from common.handoff import (KV_TRANSFER_PARAMS, DecodeParams, HandoffError, LegParams, QueuedDecodeParams, parse_leg,
                            queued_leg)
from common.openai_wire import WORKER_DRAINING, error_body, load_object
from common.stream_resume import HANDED_BACK, RESUME_FROM, RESUME_TEXT, TOKEN_IDS, Resumed, resume_from, wants_token_ids
from common.unserved import first_unserved
from worker.errors import (DrainingError, InvalidRequestError, KVTransferError, QueueFullError, RemotePrefillError,
                           StreamHandedBack, invalid)
from worker.multimodal.prompt import IMAGE_MARKER, MEDIA_PART_TYPES, MediaPart
from worker.sampling_params import SamplingParams
from worker.server.responses import Kind
from worker.server.sampling_wire import opt as _opt, parse_sampling
from worker.server.structured_wire import parse_grammar

MAX_PROMPTS = 1024   # prompts in one completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS)
_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class GenerateRequest:
    """One validated /v1/completions or /v1/chat/completions body: n choices of each of its prompts."""

    kind: Kind
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: one or more
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    media: list[MediaPart] = field(default_factory=list)          # chat: its image parts, in order
    max_tokens: int | None = None  # None: the default for the endpoint, bounded by the context
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields other than max_tokens
    n: int = 1
    echo: bool = False
    tokens_as_ids: bool = False   # return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    structured: dict[str, Any] = field(default_factory=dict)   # the body's constraint fields, as sent
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    # Disaggregation: the leg this request is (kv_transfer_params), None for a whole request.
    leg: LegParams | QueuedDecodeParams | None = None
    token_ids: bool = False               # each choice carries its token ids (common/stream_resume.py)
    resume_from: Resumed = Resumed()      # the outputs of an answer another worker began

    @property
    def hide_output(self) -> bool:
        """Echo with max_tokens 0: the answer is the prompt; the engine still runs one token, as vLLM's does."""
        return self.echo and self.max_tokens == 0

    @property
    def num_logprobs(self) -> int | None:
        return self.sampling.get("logprobs")

    @property
    def is_decode_leg(self) -> bool:
        return isinstance(self.leg, (DecodeParams, QueuedDecodeParams))

    @property
    def continues_chat(self) -> bool:
        """A chat whose messages hold an answer already: a conversation under way, whose next turn likely comes."""
        return any(m["role"] == "assistant" for m in self.messages)

    def wire_sampling(self) -> dict[str, Any]:
        """The sampling fields as a request body spells them (the constraint as the client sent it)."""
        return {**{k: v for k, v in self.sampling.items() if k != "grammar"}, **self.structured}


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decodes a request body that must be one JSON object, not nested too deeply."""
    try:
        return load_object(raw)
    except ValueError as exc:
        raise invalid(str(exc)) from exc


def parse_request(kind: Kind, body: Mapping[str, Any], model_name: str) -> GenerateRequest:
    """Validates a completion or chat body against the served model; raises InvalidRequestError."""
    model = _opt(body, "model", str)
    if model is not None and model != model_name:
        raise invalid(f"The model `{model}` does not exist.", "model")
    # Completions add BOS to a text prompt; a chat template writes its own special tokens.
    if (unserved := first_unserved(body, kind != "completion")) is not None:
        raise invalid(unserved[1], unserved[0])
    stream = bool(_opt(body, "stream", bool))
    options = _opt(body, "stream_options", dict) or {}
    include_usage = _opt(options, "include_usage", bool, "stream_options.include_usage")
    continuous = _opt(options, "continuous_usage_stats", bool, "stream_options.continuous_usage_stats")
    echo = bool(_opt(body, "echo", bool))
    max_tokens = _max_tokens(kind, body, echo)
    sampling = parse_sampling(kind, body, stream)
    structured = {}
    if (constraint := parse_grammar(body)) is not None:
        sampling["grammar"], field_name = constraint
        structured = {field_name: body[field_name]}
    n = _n(body, sampling)
    media: list[MediaPart] = []
    request = GenerateRequest(
        kind=kind,
        prompts=_parse_prompts(body) if kind == "completion" else [],
        messages=_parse_messages(body, media) if kind == "chat" else [],
        media=media, max_tokens=max_tokens, sampling=sampling, n=n, echo=echo,
        tokens_as_ids=bool(_opt(body, "return_tokens_as_token_ids", bool)), structured=structured, stream=stream,
        include_usage=stream and bool(include_usage), continuous_usage=stream and bool(continuous),
        **_resume_fields(body),
    )
    if request.resume_from and (n > 1 or len(request.prompts) > 1 or echo):
        raise invalid("a resumed answer is one choice of one prompt, without echo", RESUME_FROM)
    if (params := _opt(body, KV_TRANSFER_PARAMS, dict)) is None:
        return request
    if n > 1 or len(request.prompts) > 1:
        raise invalid("a disaggregated leg (kv_transfer_params) carries one choice of one prompt: send a leg "
                      "pair per prompt and choice (choice i with seed + i)", "n" if n > 1 else "prompt")
    try:
        return dataclasses.replace(request, leg=queued_leg(params) or parse_leg(params))
    except HandoffError as exc:
        raise invalid(str(exc), KV_TRANSFER_PARAMS) from exc


def _resume_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return {"token_ids": wants_token_ids(body), "resume_from": resume_from(body)}
    except ValueError as exc:
        param = next((key for key in (RESUME_TEXT, RESUME_FROM) if key in str(exc)), TOKEN_IDS)
        raise invalid(str(exc), param) from exc


def _max_tokens(kind: Kind, body: Mapping[str, Any], echo: bool) -> int | None:
    limit = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _opt(body, limit, int)
    if max_tokens is not None and max_tokens <= 0 and not (max_tokens == 0 and echo and kind == "completion"):
        raise invalid(f"{limit} must be at least 1, got {max_tokens}", limit)
    return max_tokens


def _n(body: Mapping[str, Any], sampling: Mapping[str, Any]) -> int:
    n = _opt(body, "n", int)
    if n is None:
        return 1
    if n < 1:
        raise invalid(f"n must be at least 1, got {n}.", "n")
    if n > 1 and sampling.get("temperature", 1.0) == 0:
        raise invalid(f"n must be 1 when using greedy sampling, got {n}.", "n")
    return n


def check_text_fits(request: GenerateRequest, num_chars: int, min_tokens: int, max_model_len: int) -> None:
    """Refuses a prompt text that cannot fit the context whatever its tokens, before it is tokenized:
    tokenizing megabytes of text would hold up every other request of the server for seconds."""
    if min_tokens >= max_model_len:
        raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, the prompt "
                      f"has {num_chars} characters, at least {min_tokens} tokens. Please reduce the prompt.",
                      "messages" if request.kind == "chat" else "prompt")


def build_params(request: GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """SamplingParams for a tokenized prompt; the prompt plus its output must fit the model's context."""
    room = max_model_len - num_prompt_tokens
    param = "messages" if request.kind == "chat" else "prompt"
    wanted_tokens = 1 if request.hide_output else request.max_tokens
    if room <= 0:  # whatever max_tokens says: a disaggregated prefill leg asks for 1 token, the client more
        raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, the prompt has "
                      f"{num_prompt_tokens} tokens, which leaves no room for a completion. Please reduce the "
                      "prompt.", param)
    if wanted_tokens is not None and wanted_tokens > room:
        wanted = num_prompt_tokens + wanted_tokens
        raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                      f"{wanted} tokens ({num_prompt_tokens} in the prompt, {wanted_tokens} in the "
                      "completion). Please reduce the prompt or max_tokens.", param)
    # vLLM's defaults: completions produce 16 tokens, chat may fill the context.
    default = 16 if request.kind == "completion" else room
    max_tokens = wanted_tokens if wanted_tokens is not None else min(default, room)
    return SamplingParams(max_tokens=max_tokens, **request.sampling)  # its InvalidRequestError names the field


def _parse_prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """A completion's prompts: a string or token ids, or a non-empty list of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid(f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_PROMPTS}.",
                          "prompt")
        return list(prompt)
    raise invalid("`prompt` must be a string, a non-empty list of token ids, or a non-empty list of those",
                  "prompt")


def _is_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _parse_messages(body: Mapping[str, Any], media: list[MediaPart]) -> list[dict[str, str]]:
    """The messages with their contents as text; image parts go to `media` and IMAGE_MARKER into the text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("`messages` must be a non-empty list", "messages")
    return [_parse_message(m, i, media) for i, m in enumerate(messages)]


def _parse_message(message: Any, index: int, media: list[MediaPart]) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise invalid(f"{param} must be an object with a role in {list(_ROLES)}", param)
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(_parse_part(p, f"{param}.content[{i}]", media) for i, p in enumerate(content))
    elif isinstance(content, str):
        _check_text(content, f"{param}.content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise invalid(f"{param}.content must be a string or a list of content parts", param)
    return {"role": message["role"], "content": content}


def _parse_part(part: Any, param: str, media: list[MediaPart]) -> str:
    """A content part's text; a media part's text is IMAGE_MARKER, the part itself goes to `media`."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return _check_text(part["text"], param)
    if kind in MEDIA_PART_TYPES and isinstance(part.get(kind), dict):
        media.append(MediaPart(param, kind, part[kind]))
        return IMAGE_MARKER
    raise invalid(f"{param}: a content part must be {{\"type\": \"text\", \"text\": ...}} or one of "
                  f"{list(MEDIA_PART_TYPES)} with an object under its type", param)


def _check_text(text: str, param: str) -> str:
    if IMAGE_MARKER in text:   # it would be taken for an image's place
        raise invalid(f"{param}: the text must not contain {IMAGE_MARKER!r}", param)
    return text


def models_body(model_name: str, max_model_len: int, created: int, dtype: str, hidden_size: int) -> dict[str, Any]:
    """The served model; `dtype` and `hidden_size` are what image embeddings sent to it must be (rows of)."""
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "neuron-di", "root": model_name,
                                        "max_model_len": max_model_len, "dtype": dtype, "hidden_size": hidden_size}]}


# ---- errors: the one place where worker errors become HTTP statuses ---------------------------


def error_for(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The HTTP status, body and headers for any error raised while serving a request."""
    if isinstance(exc, HTTPException):  # routing and framework errors: 404, 405, 413, ...
        status = exc.code or 500
        err_type = _HTTP_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        return status, error_body(status, exc.description or exc.name, err_type), {}
    headers: dict[str, str] = {}
    if isinstance(exc, InvalidRequestError):
        status, err_type = 400, "invalid_request_error"
    elif isinstance(exc, QueueFullError):
        status, err_type = 503, "server_overloaded"
    elif isinstance(exc, DrainingError):
        status, err_type = 503, HANDED_BACK if isinstance(exc, StreamHandedBack) else WORKER_DRAINING
        headers["Retry-After"] = RETRY_AFTER
    elif isinstance(exc, KVTransferError):  # its message names the prefill peer and what went wrong
        failed = 502 if isinstance(exc, RemotePrefillError) else 500  # the prefill worker failed, not this one
        status, err_type = (503 if exc.retryable else failed), "kv_transfer_error"
        if exc.retryable:  # e.g. the prefill peer was slow or restarted; through the proxy maybe another one
            headers["Retry-After"] = RETRY_AFTER
    else:
        status, err_type = 500, "server_error"
    body = error_body(status, str(exc) or type(exc).__name__, err_type, getattr(exc, "param", None))
    if isinstance(exc, StreamHandedBack) and exc.kv is not None:   # where the next worker pulls the stream's KV
        body["error"][KV_TRANSFER_PARAMS] = exc.kv.to_dict()
    return status, body, headers


_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "method_not_allowed"}
RETRY_AFTER = "1"  # seconds: a retry gets a fresh prefill leg at once
