"""Client requests: validation (400 before any worker is touched) and the bodies of both legs."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from common.handoff import KV_TRANSFER_PARAMS, DecodeParams, PrefillParams
from common.openai_wire import CHAT_ID_PREFIX, COMPLETION_ID_PREFIX, SEED_MAX, SEED_MIN, load_object
from common.unserved import first_unserved
from common.worker_record import OUR_SERVER
from proxy.errors import BadRequest
from proxy.workers import VLLM_SERVER, WorkerRecord

SEED_RANGE = 2**31  # seeds the proxy draws lie in [0, SEED_RANGE)
_UNUSED_TOKEN_KEYS = ("seed", "stop", "stop_token_ids", "min_tokens")  # dropped from a prefill leg whose token is not used
# At most this many answers (prompts x choices) per request: each is a disaggregated request of its own.
MAX_ANSWERS = 256
GREEDY_TEMPERATURE = 1e-5  # a temperature below it samples greedily (vLLM's bound)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An OpenAI endpoint the proxy serves, with the id prefix and object names it uses."""

    path: str
    id_prefix: str
    object_name: str
    chunk_object: str
    is_chat: bool


COMPLETIONS = Endpoint("/v1/completions", COMPLETION_ID_PREFIX, "text_completion", "text_completion", False)
CHAT = Endpoint("/v1/chat/completions", CHAT_ID_PREFIX, "chat.completion", "chat.completion.chunk", True)


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A validated client request; `body` is the client's JSON object, never mutated."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int | None
    include_usage: bool
    seed: int | None
    n: int = 1
    num_prompts: int = 1
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)


def parse_request(endpoint: Endpoint, raw: bytes, disaggregated: bool) -> ClientRequest:
    """Validates a request body; BadRequest names the offending parameter."""
    try:
        body = load_object(raw)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", "model")
    if endpoint.is_chat:
        _check_messages(body.get("messages"))
        num_prompts = 1
    else:
        num_prompts = len(prompts(_check_prompt(body.get("prompt"))))
    stream = _optional(body, "stream", bool, False)
    options = _optional(body, "stream_options", dict, {})
    include_usage = _optional(options, "include_usage", bool, False) and stream
    continuous = include_usage and _optional(options, "continuous_usage_stats", bool, False)
    max_tokens = _max_tokens(body, endpoint)
    seed = _seed(body)
    n = _optional(body, "n", int, 1)
    if n < 1:
        raise BadRequest("'n' must be a positive integer", "n")
    if disaggregated:
        _check_answers(body, n, num_prompts)
    return ClientRequest(endpoint, body, model, stream, max_tokens, include_usage, seed, n, num_prompts, continuous)


def _check_answers(body: dict[str, Any], n: int, num_prompts: int) -> None:
    """What a worker would refuse of a request for several answers, though not of each answer alone (n=1),
    which is what the workers get; and a bound on how many legs one request makes."""
    temperature = body.get("temperature")
    if n > 1 and isinstance(temperature, (int, float)) and temperature < GREEDY_TEMPERATURE:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {n}", "n")
    if n * num_prompts > MAX_ANSWERS:
        raise BadRequest(f"at most {MAX_ANSWERS} answers (prompts x n) per request, asked for {n * num_prompts}",
                         "n" if n > 1 else "prompt")


def prefill_alone(request: ClientRequest) -> bool:
    """Whether the prefill worker serves the request whole, without a decode leg or moving KV: one token at
    most, or what only a prefill computes (the prompt echoed, prompt logprobs), or beam search (whose beams
    share one prompt pass, not a stream to stitch)."""
    body = request.body
    return (request.max_tokens is not None and request.max_tokens <= 1) or bool(body.get("echo")) \
        or body.get("prompt_logprobs") is not None or bool(body.get("use_beam_search"))


def prompts(prompt: Any) -> list[Any]:
    """A completion request's prompts: a string or a list of token ids is one, a list of either is several."""
    if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], (str, list))):
        return [prompt]
    return list(prompt)


def _optional(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass: True must not pass as a count.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"'{name}' must be of type {kind.__name__}", name)
    return value


def _seed(body: dict[str, Any]) -> int | None:
    """The client's seed, checked here: both legs get it, and a worker cannot take one beyond int64."""
    seed = _optional(body, "seed", int, None)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise BadRequest("'seed' must be an int in [-2**63, 2**63)", "seed")
    return seed


def _max_tokens(body: dict[str, Any], endpoint: Endpoint) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if endpoint.is_chat else ("max_tokens",)
    values = [(name, _optional(body, name, int, None)) for name in names]
    for name, value in values:
        if value is not None and value < 0:
            raise BadRequest(f"'{name}' must be a non-negative integer", name)
    return next((value for _, value in values if value is not None), None)


def _check_prompt(prompt: Any) -> Any:
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or _token_ids(prompt):
            return prompt
        if all(isinstance(p, list) and p and _token_ids(p) for p in prompt):
            return prompt
    raise BadRequest("'prompt' must be a non-empty string, list of strings or list of token ids", "prompt")


def _token_ids(values: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("each message must be an object with a string 'role'", "messages")


def leg_seed(request: ClientRequest) -> int | None:
    """The seed of both legs: the client's, one drawn for a sampled request, None for greedy.

    A vLLM decode worker samples the first token again itself; only the same seed on both
    legs makes a sampled request give what one server gives. A greedy request is left
    unseeded: vLLM's CPU build kills its engine on a seeded request whose prompt is
    prefilled in chunks ("CPU Generator does not use offset").
    """
    if request.seed is not None:
        return request.seed
    return None if request.body.get("temperature") == 0 else random.randrange(SEED_RANGE)


def _seeded(body: dict[str, Any], seed: int | None) -> dict[str, Any]:
    return body if seed is None else {**body, "seed": seed}


def refuse_unserved(request: ClientRequest, workers: list[WorkerRecord]) -> None:
    """BadRequest, before any leg is sent, for a parameter our worker does not serve, when every worker the
    request may go to is ours (a `vllm serve` serves some of them, and a worker of unknown server answers for
    itself); the same words our worker answers."""
    if not workers or any(worker.server != OUR_SERVER for worker in workers):
        return
    if (unserved := first_unserved(request.body, request.endpoint.is_chat)) is not None:
        raise BadRequest(unserved[1], unserved[0])


def prefill_token_used(prefill: WorkerRecord, seed: int | None) -> bool:
    """Whether the prefill leg's token is the answer's first token: always, but on `vllm serve`. A vLLM prefill
    worker's leg goes unseeded (vLLM's CPU build stops its engine on a seeded prompt prefilled in chunks,
    which it does with chunked prefill on, its default), so its token is the answer's for a greedy request
    only; a sampled request's first token is the decode worker's, which samples it again with the seed."""
    return prefill.server != VLLM_SERVER or seed is None


def prefill_body(request: ClientRequest, seed: int | None, kv_transfer_params: dict[str, Any],
                 token_used: bool = True) -> dict[str, Any]:
    """A prefill leg: the client's body, one token, not streamed. `min_tokens` above 1 becomes 1, which
    bans the same for that one token (ending the answer there), and a worker refuses a `min_tokens` above
    `max_tokens`. One whose token is not used (`prefill_token_used`) is unseeded and samples its one token
    whatever stop conditions say, so that its KV is always kept for the decode leg."""
    if token_used:
        body = {**_seeded(request.body, seed), "max_tokens": 1, "stream": False,
                KV_TRANSFER_PARAMS: kv_transfer_params}
    else:
        body = {**{k: v for k, v in request.body.items() if k not in _UNUSED_TOKEN_KEYS},
                "max_tokens": 1, "stream": False, "ignore_eos": True, KV_TRANSFER_PARAMS: kv_transfer_params}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 1:
        body["min_tokens"] = 1
    body.pop("stream_options", None)
    return body


def decode_body(request: ClientRequest, seed: int | None, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """A decode leg: the client's body with the legs' seed and the handoff."""
    return {**_seeded(request.body, seed), KV_TRANSFER_PARAMS: kv_transfer_params}


def neuron_prefill_params(uid: str, decode: WorkerRecord | None = None, pulled_on_stop: bool = True) -> dict[str, Any]:
    """Our signal plane, prefill: which request the KV blocks it keeps belong to, and (when it registered
    one) the engine id of the decode worker that will pull them."""
    decode_engine_id = decode.engine_id if decode is not None and decode.engine_id else None
    return PrefillParams(uid, pulled_on_stop, decode_engine_id).to_dict()


def neuron_decode_params(uid: str, prefill: WorkerRecord) -> dict[str, Any]:
    """Our signal plane, decode: where to pull the prompt's KV blocks from, and (when the prefill
    registered it) the engine id its handshake must show."""
    return neuron_decode_leg(uid, prefill).to_dict()


def neuron_decode_leg(uid: str, prefill: WorkerRecord) -> DecodeParams:
    """The decode leg of `uid` as the prefill worker's record places its KV."""
    return DecodeParams(prefill.kv_host, prefill.kv_port, uid, prefill.engine_id or None)
