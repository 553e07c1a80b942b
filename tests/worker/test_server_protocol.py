"""The wire format without I/O: request validation, sampling defaults, response and error shapes."""
from __future__ import annotations

import json

import pytest

from common.handoff import ForeignParams
from common.openai_wire import sse_event
from worker.errors import InvalidRequestError, KVTransferError, QueueFullError, WorkerError
from worker.sampling_params import SamplingParams
from worker.server.protocol import build_params, error_for, parse_body, parse_request
from worker.server.responses import ChoiceBody, ResponseShape, usage

MODEL = "m"


def test_completion_fields_become_sampling_params() -> None:
    req = parse_request("completion", {"model": "m", "prompt": ["hello"], "temperature": 0, "top_p": 0.5,
                                       "top_k": -1, "seed": 7, "stop": "\n", "ignore_eos": True,
                                       "max_tokens": 5, "kv_transfer_params": {"do_remote_decode": True}},
                        MODEL)
    assert req.prompts == ["hello"] and req.leg == ForeignParams({"do_remote_decode": True})
    params = build_params(req, num_prompt_tokens=3, max_model_len=100)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, params.stop,
            params.ignore_eos) == (5, 0.0, 0.5, 0, 7, ["\n"], True)


def test_default_max_tokens_is_16_for_completions_and_the_rest_of_the_context_for_chat() -> None:
    completion = parse_request("completion", {"prompt": [1, 2]}, MODEL)
    chat = parse_request("chat", {"messages": [{"role": "user", "content": "x"}]}, MODEL)
    assert build_params(completion, 2, 100).max_tokens == 16
    assert build_params(completion, 90, 100).max_tokens == 10
    assert build_params(chat, 30, 100).max_tokens == 70


def test_chat_prefers_max_completion_tokens_and_flattens_text_parts() -> None:
    req = parse_request("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]},
                                              {"role": "assistant", "content": None}],
                                 "max_tokens": 9, "max_completion_tokens": 4}, MODEL)
    assert req.messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    assert req.max_tokens == 4
    with pytest.raises(InvalidRequestError, match="max_completion_tokens must be at least 1, got 0"):
        parse_request("chat", {"messages": req.messages, "max_tokens": 9, "max_completion_tokens": 0}, MODEL)


def test_include_usage_only_applies_to_streams() -> None:
    body = {"prompt": "x", "stream_options": {"include_usage": True}}
    assert parse_request("completion", body, MODEL).include_usage is False
    assert parse_request("completion", {**body, "stream": True}, MODEL).include_usage is True


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "top_k": 1.5}, "top_k"),
    ({"prompt": "x", "seed": True}, "seed"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop"),
    ({"prompt": "x", "kv_transfer_params": "peer"}, "kv_transfer_params"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["x", []]}, "prompt"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "temperature": 0}, "n"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": ["x", "y"], "kv_transfer_params": {"role": "prefill"}}, "prompt"),
    ({"prompt": "x", "n": 2, "kv_transfer_params": {"role": "decode"}}, "n"),
    ({"prompt": "x", "kv_transfer_params": {"role": "decode", "remote_port": 1}}, "kv_transfer_params"),
    ({"prompt": "x", "kv_transfer_params": {"role": "both"}}, "kv_transfer_params"),
])
def test_ill_typed_fields_name_their_param(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request("completion", body, MODEL)
    assert info.value.param == param  # type: ignore[attr-defined]


def test_sampling_params_rejections_become_invalid_requests() -> None:
    req = parse_request("completion", {"prompt": "x", "top_p": 0}, MODEL)
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\]"):
        build_params(req, 2, 100)


def test_body_must_be_a_json_object() -> None:
    assert parse_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"", b"\xff", b"[]", b"null"):
        with pytest.raises(InvalidRequestError):
            parse_body(raw)


def test_error_statuses_and_bodies() -> None:
    assert error_for(QueueFullError("the waiting queue is full")) == (503, {"error": {
        "message": "the waiting queue is full", "type": "server_overloaded", "param": None, "code": 503}}, {})
    assert error_for(WorkerError("engine step failed: boom"))[0] == 500
    assert error_for(RuntimeError())[1]["error"]["message"] == "RuntimeError"


def test_a_failed_kv_transfer_says_so_and_whether_a_retry_may_succeed() -> None:
    message = "KV transfer of request 'r' from the prefill worker failed: prefill peer 10.0.0.1:14579 timed out"
    assert error_for(KVTransferError(message, retryable=True)) == (503, {"error": {
        "message": message, "type": "kv_transfer_error", "param": None, "code": 503}}, {"Retry-After": "1"})
    status, body, headers = error_for(KVTransferError("prefill peer 10.0.0.1:14579 refused our KV layout"))
    assert (status, body["error"]["type"], headers) == (500, "kv_transfer_error", {})


def test_stream_chunks_are_shaped_like_vllms() -> None:
    shape = ResponseShape("chat", "abc", MODEL, created=5)
    assert shape.role_chunk(1) == {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 5,
                                   "model": "m", "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""},
                                                              "logprobs": None, "finish_reason": None}],
                                   "prompt_token_ids": None, "prompt_text": None}
    assert shape.chunk(ChoiceBody(0, "Hi"))["choices"] == [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None,
                                                            "finish_reason": None, "token_ids": None}]
    last = shape.usage_chunk(usage(3, 2, details=False))
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
    event = sse_event(ResponseShape("completion", "abc", MODEL, 5).chunk(ChoiceBody(0, "x", None, "stop", 7)))
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert json.loads(event[6:])["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "stop",
                                                 "stop_reason": 7, "prompt_token_ids": None, "token_ids": None}]


@pytest.mark.parametrize("seed", [2**63, -2**63 - 1, 2**100])
def test_a_seed_outside_int64_is_refused_naming_seed(seed: int) -> None:
    req = parse_request("completion", {"prompt": "x", "seed": seed}, MODEL)
    with pytest.raises(InvalidRequestError, match=r"seed must be an int in \[-2\*\*63, 2\*\*63\)") as info:
        build_params(req, 2, 100)
    assert info.value.param == "seed"  # type: ignore[attr-defined]


def test_the_int64_bounds_are_seeds() -> None:
    for seed in (-2**63, 2**63 - 1):
        assert build_params(parse_request("completion", {"prompt": "x", "seed": seed}, MODEL), 2, 100).seed == seed


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000,
                                 b'{"prompt": "x", "extra": ' + b"[" * 500 + b"]" * 500 + b"}"],
                         ids=["beyond-the-recursion-limit", "within-it"])
def test_a_deeply_nested_body_is_invalid(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError, match="request body is nested more than 64 levels deep"):
        parse_body(raw)


def test_a_body_nested_64_levels_deep_is_accepted() -> None:
    raw = b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}"
    assert parse_body(raw)["a"] == json.loads(raw)["a"]


# vLLM's parameters this server does not implement, each set to a value that asks for something.
UNSUPPORTED = [
    ("best_of", 3), ("use_beam_search", True), ("length_penalty", 0.5), ("logprob_token_ids", [3]),
    ("suffix", "}"), ("include_stop_str_in_output", True),
    ("skip_special_tokens", False), ("spaces_between_special_tokens", False), ("add_special_tokens", False),
    ("truncate_prompt_tokens", 5), ("allowed_token_ids", [1]), ("bad_words", ["x"]), ("priority", 1),
    ("guided_regex", "a+"), ("guided_json", {"type": "object"}), ("guided_choice", ["a"]),
    ("guided_grammar", "root ::= x"),
    ("logits_processors", ["p"]), ("return_token_ids", True),
    ("prompt_embeds", "AAAA"), ("vllm_xargs", {"k": 1}), ("tools", [{"type": "function"}]),
    ("tool_choice", "required"), ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}),
    ("add_generation_prompt", False), ("continue_final_message", True), ("chat_template", "{{ x }}"),
    ("chat_template_kwargs", {"k": 1}), ("documents", [{"text": "d"}]), ("modalities", ["audio"]),
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("name,value", UNSUPPORTED)
def test_unsupported_parameters_are_refused_unless_at_their_default(kind: str, name: str, value: object) -> None:
    base = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "x"}]}
    if kind == "chat" and name == "add_special_tokens":
        value = True  # chat's default is false: the template has the special tokens
    with pytest.raises(InvalidRequestError, match=f"`{name}` is not supported by this server") as info:
        parse_request(kind, {**base, name: value}, MODEL)  # type: ignore[arg-type]
    assert info.value.param == name  # type: ignore[attr-defined]


def test_request_shapes_become_choices_and_engine_params() -> None:
    req = parse_request("completion", {"prompt": ["a", [5, 6]], "n": 3, "echo": True, "logprobs": 2,
                                       "max_tokens": 0, "logit_bias": {"7": 200}, "stop_token_ids": [9, 9]}, MODEL)
    assert (req.prompts, req.n, req.hide_output, req.num_logprobs) == (["a", [5, 6]], 3, True, 2)
    params = build_params(req, 2, 100)   # echo with max_tokens 0 runs one token, as vLLM's engine does
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (1, 2, 2)
    assert (params.logit_bias, params.stop_token_ids) == ({7: 100.0}, [9])   # clamped, deduplicated
    chat = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 3, "echo": True}, MODEL)
    assert (chat.num_logprobs, chat.sampling["prompt_logprobs"]) == (3, 3)
    with pytest.raises(InvalidRequestError, match="`logprobs` must be set to true"):
        parse_request("chat", {"messages": chat.messages, "top_logprobs": 3}, MODEL)
    usage_stats = parse_request("completion", {"prompt": "x", "stream": True,
                                               "stream_options": {"continuous_usage_stats": True}}, MODEL)
    assert usage_stats.continuous_usage


DEFAULTS = {
    "best_of": 1, "use_beam_search": False, "length_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0, "logit_bias": {},
    "prompt_logprobs": None, "echo": False, "suffix": "", "stop_token_ids": [],
    "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "add_special_tokens": True, "priority": 0, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
    "modalities": ["text"], "stream_options": {"continuous_usage_stats": False},
    # No effect on what is generated: accepted, as vLLM does.
    "user": "alice", "metadata": {"k": "v"}, "store": False, "cache_salt": "s", "parallel_tool_calls": True,
}


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "the 'json_schema' field must be provided"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format", "cannot be compiled: Invalid type: nonsense"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "cannot be compiled"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "only use one kind"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "`structured_outputs.grammar` is not"),
    ({"structured_outputs": {"choice": "b"}}, "structured_outputs", "must be a list of strings"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs", "must be a JSON schema"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format", "not both"),
])
def test_bad_structured_output_constraints_name_their_field(body: dict, param: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        parse_request("completion", {"prompt": "x", **body}, MODEL)
    assert info.value.param == param  # type: ignore[attr-defined]


def test_structured_output_constraints_become_a_grammar_and_keep_their_wire_form() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                 {"response_format": {"type": "json_object"}}, {"structured_outputs": {"json": schema}},
                 {"structured_outputs": {"regex": "[ab]+"}}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        req = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], **body}, MODEL)
        assert isinstance(build_params(req, 2, 100).grammar, str)
        assert req.wire_sampling() == body   # what a decode_first leg sends its prefill worker
    assert "grammar" not in parse_request("completion", {"prompt": "x", "response_format": {"type": "text"}},
                                          MODEL).sampling


def test_parameters_at_their_default_or_without_effect_are_accepted() -> None:
    params = build_params(parse_request("completion", {"prompt": "x", **DEFAULTS}, MODEL), 2, 100)
    assert params == SamplingParams(max_tokens=16)
    chat = {"messages": [{"role": "user", "content": "x"}], **DEFAULTS, "add_special_tokens": False,
            "tool_choice": "auto", "add_generation_prompt": True, "continue_final_message": False}
    assert build_params(parse_request("chat", chat, MODEL), 2, 100) == SamplingParams(max_tokens=98)
