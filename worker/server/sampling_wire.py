"""A request body's sampling fields as SamplingParams keyword arguments, sans I/O.

Types are checked here, with vLLM's messages where it has them; value ranges are SamplingParams'
(and the engine's, for what needs the vocabulary) to check.
"""
from __future__ import annotations

from typing import Any, Mapping

from worker.errors import invalid

_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}
_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int, "ignore_eos": bool,
           "min_tokens": int, "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
           "prompt_logprobs": int}


def opt(body: Mapping[str, Any], key: str, kind: type, param: str | None = None) -> Any:
    """body[key] if present and not null, checked to be of `kind` (bool is not an int here)."""
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise invalid(f"`{param or key}` must be of type {_TYPE_NAMES[kind]}", param or key)
    return value


def parse_sampling(kind: str, body: Mapping[str, Any], stream: bool) -> dict[str, Any]:
    """SamplingParams fields other than max_tokens (the engine's logprobs included, echo's prompt logprobs too)."""
    sampling = {name: value for name, kind_ in _FIELDS.items() if (value := opt(body, name, kind_)) is not None}
    if sampling.get("top_k") == -1:  # vLLM's spelling of "top-k off"
        sampling["top_k"] = 0
    if (stop := _stop(body)) is not None:
        sampling["stop"] = stop
    if (ids := opt(body, "stop_token_ids", list)) is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise invalid("`stop_token_ids` must be a list of integers", "stop_token_ids")
        sampling["stop_token_ids"] = ids
    if (bias := opt(body, "logit_bias", dict)) is not None:
        sampling["logit_bias"] = _logit_bias(bias)
    logprobs = _logprobs(kind, body)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    prompt_logprobs = sampling.get("prompt_logprobs")
    if stream and prompt_logprobs is not None and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise invalid("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if prompt_logprobs is None and opt(body, "echo", bool):
        # Echo shows the prompt's logprobs (completions) or computes them (chat), as vLLM does.
        echoed = logprobs if kind == "completion" else (opt(body, "top_logprobs", int) or 0)
        if echoed is not None:
            sampling["prompt_logprobs"] = echoed
    return sampling


def _stop(body: Mapping[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise invalid("`stop` must be a string or a list of strings", "stop")


def _logit_bias(bias: dict[str, Any]) -> dict[int, float]:
    keys, bad = [], []
    for key in bias:
        try:
            keys.append(int(key))
        except ValueError:
            bad.append(key)
    if bad:
        raise invalid(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                      "logit_bias")
    values = list(bias.values())
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise invalid("`logit_bias` values must be numbers", "logit_bias")
    return dict(zip(keys, (float(v) for v in values)))


def _logprobs(kind: str, body: Mapping[str, Any]) -> int | None:
    """How many top logprobs each output token shows; None: no logprobs. Chat asks with `logprobs: true`
    and `top_logprobs: k`; completions with `logprobs: k`."""
    if kind == "completion":
        return opt(body, "logprobs", int)
    wanted = opt(body, "logprobs", bool)
    top = opt(body, "top_logprobs", int)
    if top is not None and (top > 0 or top == -1) and not wanted:
        raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if top is not None and top < 0 and top != -1:
        raise invalid("`top_logprobs` must be a positive value or -1.", "top_logprobs")
    return (top or 0) if wanted else None
