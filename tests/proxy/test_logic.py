"""The sans-I/O parts, driven with plain bytes and dicts: SSE, stitching, requests, picking, config."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import neuron_connector
from neuron_connector import RegistrationError
from proxy import (CHAT, COMPLETIONS, KV_PROTOCOLS, BadRequest, ConfigError, NoWorkers, SSEDecoder,
                   StreamStitcher, UpstreamProtocol, UpstreamStatus, UpstreamTimeout, UpstreamUnavailable,
                   WorkerPool, WorkerRecord, parse_args, parse_request, pick, summed_usage, to_http)
from common.handoff import nixl_prefill_params
from common.worker_record import OUR_SERVER, VLLM_SERVER
from proxy.requests import (SEED_RANGE, decode_body, leg_seed, neuron_decode_params, neuron_prefill_params,
                            prefill_body, refuse_unserved)
from proxy.stitch import first_token_repeated, prefill_answer
from proxy.workers import completed, contradiction, shown_record

STREAM = (b"data: {\"a\": 1}\n\n: keep-alive comment\n\nevent: message\r\ndata: {\"b\":\r\ndata: 2}\r\n\r\n"
          b"id: 7\rdata: [DONE]\r\r")


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), unique=True))
def test_sse_decoder_is_independent_of_how_bytes_are_cut(cuts: list[int]) -> None:
    decoder, events, start = SSEDecoder(), [], 0
    for cut in sorted(cuts) + [len(STREAM)]:
        events += decoder.feed(STREAM[start:cut])
        start = cut
    events += decoder.end()
    assert events == ['{"a": 1}', '{"b":\n2}', "[DONE]"]
    assert not decoder.pending


def test_sse_decoder_reports_a_cut_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a": 1}\n\ndata: {"b"') == ['{"a": 1}']
    assert decoder.pending


def _request(endpoint=COMPLETIONS, **body) -> object:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if endpoint.is_chat else \
        {"model": "m", "prompt": "hi"}
    return parse_request(endpoint, json.dumps({**base, **body}).encode(), disaggregated=True)


def _chunk(choice: dict) -> str:
    return json.dumps({"id": "cmpl-worker", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [choice]})


def _events(raw: list[bytes]) -> list:
    return [json.loads(e[6:]) if e != b"data: [DONE]\n\n" else "[DONE]" for e in raw]


PREFILL = {"id": "cmpl-p", "model": "m", "choices": [{"index": 0, "text": " A", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def test_stitcher_skips_decodes_repeat_and_rewrites_ids() -> None:
    stitcher = StreamStitcher(_request(stream=True, stream_options={"include_usage": True}), "cmpl-X", 42, PREFILL)
    out = stitcher.first()
    for text, finish in ((" A", None), (" B", None), (" C", "length")):
        out += stitcher.feed(_chunk({"index": 0, "text": text, "finish_reason": finish}))
    out += stitcher.feed(json.dumps({"id": "w", "choices": [], "usage": {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}))
    out += stitcher.feed("[DONE]") + stitcher.close()
    events = _events(out)
    assert [e["choices"][0]["text"] for e in events[:3]] == [" A", " B", " C"]
    assert [e["choices"][0]["finish_reason"] for e in events[:3]] == [None, None, "length"]
    assert {(e["id"], e["created"], e["model"]) for e in events[:-1]} == {("cmpl-X", 42, "m")}
    assert events[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert events[4] == "[DONE]" and len(events) == 5


def test_stitcher_keeps_a_finish_reason_on_decodes_only_token() -> None:
    stitcher = StreamStitcher(_request(stream=True), "cmpl-X", 1, PREFILL)
    stitcher.first()
    events = _events(stitcher.feed(_chunk({"index": 0, "text": " A", "finish_reason": "length"})) + stitcher.close())
    assert events[0]["choices"][0] == {"index": 0, "text": "", "finish_reason": "length"}
    assert events[1] == "[DONE]"


@pytest.mark.parametrize("repeat,matched", [(" A", True), (" Z", False)])
def test_stitcher_reports_whether_decodes_first_token_is_prefills(repeat: str, matched: bool) -> None:
    stitcher = StreamStitcher(_request(stream=True), "cmpl-X", 1, PREFILL)
    stitcher.first()
    assert stitcher.first_token_matched is None
    events = stitcher.feed(_chunk({"index": 0, "text": repeat, "finish_reason": None}))
    assert events == [] and stitcher.first_token_matched is matched
    stitcher.feed(_chunk({"index": 0, "text": " A", "finish_reason": "length"}))
    assert stitcher.first_token_matched is matched


def test_chat_stitcher_checks_the_first_content_delta_not_the_role_chunk() -> None:
    prefill = {"model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": " A"},
                                          "finish_reason": "length"}]}
    stitcher = StreamStitcher(_request(CHAT, stream=True), "chatcmpl-X", 1, prefill)
    stitcher.first()
    stitcher.feed(_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
    assert stitcher.first_token_matched is None
    stitcher.feed(_chunk({"index": 0, "delta": {"content": " B"}, "finish_reason": None}))
    assert stitcher.first_token_matched is False


def test_whole_answers_first_token_check() -> None:
    assert first_token_repeated(PREFILL, {"choices": [{"text": " A B C"}]})
    assert not first_token_repeated(PREFILL, {"choices": [{"text": " Z B C"}]})
    assert first_token_repeated(PREFILL, {"choices": [{"text": " "}]}) is None  # cut short by a stop string
    chat_prefill = {"choices": [{"message": {"role": "assistant", "content": " A"}}]}
    assert first_token_repeated(chat_prefill, {"choices": [{"message": {"role": "assistant", "content": " A B"}}]})
    assert not first_token_repeated(chat_prefill, {"choices": [{"message": {"role": "assistant", "content": "B"}}]})
    with pytest.raises(UpstreamProtocol, match="answer has no choices") as failure:
        first_token_repeated(PREFILL, {"choices": []})
    assert failure.value.role == "decode"


def test_prefills_own_answer_hides_its_kv_handle() -> None:
    assert prefill_answer("cmpl-X", {**PREFILL, "kv_transfer_params": {"remote_block_ids": [1]}}) == {
        **PREFILL, "id": "cmpl-X"}


def test_stitcher_errors() -> None:
    stitcher = StreamStitcher(_request(stream=True), "cmpl-X", 1, PREFILL)
    stitcher.first()
    with pytest.raises(UpstreamProtocol):
        stitcher.feed("{not json")
    with pytest.raises(UpstreamUnavailable):
        stitcher.close()  # decode ended without a finish_reason


def test_usage_counts_decodes_repeat_once() -> None:
    assert summed_usage({"prompt_tokens": 5, "completion_tokens": 1},
                        {"prompt_tokens": 5, "completion_tokens": 9}) == {
        "prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}


def test_leg_bodies_follow_the_contract() -> None:
    request = _request(CHAT, max_completion_tokens=7, stream=True, stream_options={"include_usage": True})
    prefill = WorkerRecord("prefill", "10.0.0.1", 8100, kv_port=14600)
    assert prefill_body(request, 5, neuron_prefill_params("u1")) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "max_completion_tokens": 1, "stream": False, "seed": 5,
        "kv_transfer_params": {"role": "prefill", "request_id": "u1"}}
    decode = decode_body(request, 5, neuron_decode_params("u1", prefill))
    assert decode == {**request.body, "seed": 5, "kv_transfer_params": {
        "role": "decode", "request_id": "u1", "remote_host": "10.0.0.1", "remote_port": 14600}}
    assert decode["stream"] is True and decode["max_completion_tokens"] == 7
    assert request.max_tokens == 7 and request.include_usage
    registered = WorkerRecord("prefill", "10.0.0.1", 8100, kv_port=14600, engine_id="p-engine")
    assert neuron_decode_params("u1", registered)["remote_engine_id"] == "p-engine"


def test_nixl_leg_bodies_are_vllms_handoff() -> None:
    request = _request(COMPLETIONS, max_tokens=9, stream=True, stream_options={"include_usage": True})
    assert prefill_body(request, 11, nixl_prefill_params()) == {
        "model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "seed": 11, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    handoff = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "e"}
    assert decode_body(request, 11, handoff) == {
        "model": "m", "prompt": "hi", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
        "seed": 11, "kv_transfer_params": handoff}


@pytest.mark.parametrize("body,param,message", [
    ({"n": 0}, "n", "'n' must be a positive integer"),
    ({"n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling, got 2"),
    ({"n": 257}, "n", "at most 256 answers (prompts x n) per request, asked for 257"),
    ({"prompt": ["a", "b"], "n": 129}, "n", "at most 256 answers"),
    ({"prompt": [[1]] * 257}, "prompt", "at most 256 answers"),
    ({"seed": 2**63}, "seed", "'seed' must be an int in [-2**63, 2**63)"),
    ({"seed": -2**63 - 1}, "seed", "'seed' must be an int in [-2**63, 2**63)"),
])
def test_request_validation_names_the_parameter(body: dict, param: str, message: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(message)) as failure:
        _request(**body)
    assert failure.value.param == param


def test_seeds_are_int64_and_bodies_nest_at_most_64_levels() -> None:
    assert _request(seed=-2**63).seed == -2**63 and _request(seed=2**63 - 1).seed == 2**63 - 1
    deep = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 64 + b"]" * 64 + b"}"
    with pytest.raises(BadRequest, match="request body is nested more than 64 levels deep"):
        parse_request(COMPLETIONS, deep, disaggregated=True)
    assert parse_request(COMPLETIONS, deep.replace(b"[", b"", 1).replace(b"]", b"", 1), disaggregated=True)


def test_both_legs_seed_is_the_clients_or_one_drawn_per_request() -> None:
    assert _request(seed=0).seed == 0 and leg_seed(_request(seed=0)) == 0
    assert leg_seed(_request(seed=-3)) == -3
    drawn = {leg_seed(_request()) for _ in range(50)}
    assert len(drawn) > 1 and all(isinstance(s, int) and 0 <= s < SEED_RANGE for s in drawn)
    assert SEED_RANGE == 2**31
    for bad in ("7", True, 1.5):
        with pytest.raises(BadRequest) as failure:
            _request(seed=bad)
        assert (str(failure.value), failure.value.param) == ("'seed' must be of type int", "seed")


def test_round_robin_and_health() -> None:
    a, b = WorkerRecord("decode", "h", 2), WorkerRecord("decode", "h", 1)
    assert [pick([a, b], t) for t in range(3)] == [a, b, a]
    pool = WorkerPool([a, b, WorkerRecord("prefill", "h", 3)])
    assert [pool.next("decode").http_port for _ in range(4)] == [1, 2, 1, 2]
    assert pool.mark(b.key, healthy=False) and not pool.mark(b.key, healthy=False)
    assert [pool.next("decode").http_port for _ in range(2)] == [2, 2]
    pool.remove(a.key)
    with pytest.raises(NoWorkers, match="no healthy decode worker"):
        pool.next("decode")
    assert pool.listed("decode") == [b]   # listed, out of rotation: the prefill queue may still wait for it
    pool.retire(b.key)
    assert pool.listed("decode") == [] and [w.http_port for w in pool.listed("prefill")] == [3]


def test_decode_is_picked_among_workers_of_the_prefills_kv_protocol() -> None:
    neuron = [WorkerRecord("decode", "n", port) for port in (1, 2)]
    nixl = [WorkerRecord("decode", "x", port, kv_protocol="nixl") for port in (1, 2)]
    pool = WorkerPool([*neuron, *nixl, WorkerRecord("prefill", "p", 1, kv_protocol="nixl")])
    assert pool.healthy("decode", "nixl") == nixl and pool.healthy("decode", "neuron") == neuron
    assert [pool.next("decode", "nixl") for _ in range(3)] == [nixl[0], nixl[1], nixl[0]]
    assert [pool.next("decode", "neuron") for _ in range(3)] == [neuron[0], neuron[1], neuron[0]]
    assert pool.next("prefill").kv_protocol == "nixl"
    for worker in nixl:
        pool.mark(worker.key, healthy=False, why=f"decode worker {worker.address}: connection refused")
    with pytest.raises(NoWorkers) as failure:
        pool.next("decode", "nixl")
    # Each worker of the role that is out of rotation is named, with why.
    assert str(failure.value) == ("no healthy decode worker with kv_protocol 'nixl' is available; "
                                  "decode worker x:1: connection refused; decode worker x:2: connection refused")
    assert to_http(failure.value)[0] == 503
    assert pool.healthy("decode") == neuron


def test_worker_record_round_trips_and_rejects_garbage() -> None:
    record = WorkerRecord("prefill", "h", 8100, kv_host="k", kv_port=1, engine_id="e", model="m",
                          transfer={"backend": "shm"}, kv_protocol="nixl")
    assert json.loads(record.to_json())["kv_protocol"] == "nixl"
    assert WorkerRecord.from_json(record.to_json()) == record
    assert WorkerRecord.from_json(record.to_json()).kv_protocol == "nixl"
    for raw in (b"{", b"[]", b'{"role": "x", "host": "h", "http_port": 1}', b'{"role": "decode"}',
                b'{"role": "decode", "host": "h", "http_port": 1, "kv_protocol": "mooncake"}'):
        with pytest.raises(RegistrationError):
            WorkerRecord.from_json(raw)


def test_worker_record_rejects_an_unknown_kv_protocol() -> None:
    assert KV_PROTOCOLS == ("neuron", "nixl")
    with pytest.raises(ValueError) as failure:
        WorkerRecord("decode", "h", 8200, kv_protocol="mooncake")
    assert str(failure.value) == "worker kv_protocol must be one of ('neuron', 'nixl'), got 'mooncake'"


def test_one_worker_record_type_serves_proxy_and_workers() -> None:
    assert WorkerRecord is neuron_connector.WorkerRecord
    minimal = WorkerRecord.from_json(b'{"role": "prefill", "host": "h", "http_port": 8100}')
    assert (minimal.kv_host, minimal.kv_port, minimal.engine_id, minimal.kv_protocol) == (
        "h", 14579, "", "neuron")


def test_a_static_worker_is_completed_from_the_record_it_shows() -> None:
    given = WorkerRecord("prefill", "10.0.0.1", 8100)
    record = WorkerRecord("prefill", "0.0.0.0", 8100, kv_host="10.9.0.1", kv_port=7001, engine_id="p-engine",
                          model="m", transfer={"backend": "tcp"})
    shown = shown_record(json.dumps({"status": "ok", "worker": record.to_dict()}).encode())
    assert shown == record and shown_record(b"") is None and shown_record(b'{"status": "ok"}') is None
    learned = completed(given, record)
    assert (learned.key, learned.kv_host, learned.kv_port, learned.engine_id) == (
        given.key, "10.9.0.1", 7001, "p-engine")
    assert neuron_decode_params("u", learned) == {"role": "decode", "request_id": "u", "remote_host": "10.9.0.1",
                                                  "remote_port": 7001, "remote_engine_id": "p-engine"}
    # A signal plane bound to every address is reached at the host the proxy reaches the worker at.
    assert completed(given, WorkerRecord("prefill", "h", 8100, kv_host="0.0.0.0")).kv_host == "10.0.0.1"


def test_what_a_static_worker_shows_must_agree_with_the_command_line() -> None:
    given = WorkerRecord("prefill", "h", 8100, kv_port=7000)
    assert contradiction(given, WorkerRecord("prefill", "x", 1, kv_port=7001), kv_port_given=False) is None
    assert contradiction(given, WorkerRecord("prefill", "x", 1, kv_port=7001), kv_port_given=True) == (
        "prefill worker h:8100: the command line gives KV port 7000, "
        "but the worker's signal plane listens on port 7001")
    assert contradiction(given, WorkerRecord("prefill", "x", 1, kv_port=7000), kv_port_given=True) is None
    assert contradiction(given, WorkerRecord("decode", "x", 1), kv_port_given=False) == (
        "prefill worker h:8100: the worker there is a decode worker")
    nixl = WorkerRecord("decode", "h", 8200, kv_protocol="nixl")
    assert contradiction(nixl, WorkerRecord("decode", "x", 1), kv_port_given=False) == (
        "decode worker h:8200: driven with kv_protocol 'nixl', but the worker speaks 'neuron'")


def test_errors_map_to_statuses_in_one_place() -> None:
    assert to_http(BadRequest("bad", "prompt"))[0] == 400
    assert json.loads(to_http(BadRequest("bad", "prompt"))[1])["error"]["param"] == "prompt"
    assert to_http(NoWorkers("decode"))[0] == 503
    assert to_http(UpstreamTimeout("slow"))[0] == 504
    assert to_http(UpstreamUnavailable("gone"))[0] == 502
    assert to_http(UpstreamStatus(500, b"oops"))[0] == 502
    assert to_http(UpstreamStatus(404, b'{"x": 1}')) == (404, b'{"x": 1}', {})


def test_a_failed_kv_transfer_is_passed_on_as_one() -> None:
    message = "KV transfer of request 'r' from the prefill worker failed: prefill peer 10.0.0.1:14579 timed out"
    body = json.dumps({"error": {"message": message, "type": "kv_transfer_error", "param": None, "code": 503}})
    status, answer, headers = to_http(UpstreamStatus(503, body.encode(), "decode", "10.0.0.2:8200", retry_after="1"))
    assert (status, headers) == (503, {"Retry-After": "1"})
    assert json.loads(answer) == {"error": {"message": f"decode worker 10.0.0.2:8200: {message}",
                                            "type": "kv_transfer_error", "param": None, "code": 503}}
    status, answer, headers = to_http(UpstreamStatus(500, body.encode(), "decode", "10.0.0.2:8200"))
    assert (status, json.loads(answer)["error"]["type"], headers) == (502, "kv_transfer_error", {})


def test_config_static_1p1d_and_xpyd() -> None:
    config = parse_args(["--prefill-ip", "a", "--prefill-port", "8100", "--decode-ip", "b", "--decode-port", "8200"])
    assert [(w.role, w.address, w.kv_port) for w in config.workers] == [
        ("prefill", "a:8100", 14579), ("decode", "b:8200", 14579)]
    assert config.port == 8000 and config.mode == "di"
    config = parse_args(["--prefill", "a:1:9", "--prefill", "b:2", "--decode", "c:3", "--port", "9000"])
    assert [(w.role, w.address, w.kv_port) for w in config.workers] == [
        ("prefill", "a:1", 9), ("prefill", "b:2", 14579), ("decode", "c:3", 14579)]
    assert parse_args(["--etcd", "e:2379"]).etcd == ("e", 2379)
    assert parse_args(["--mode", "colocated", "--worker", "w:1"]).workers[0].role == "both"


def test_config_knows_which_prefill_kv_ports_the_command_line_names() -> None:
    one_p_one_d = ["--prefill-ip", "a", "--prefill-port", "1", "--decode-ip", "b", "--decode-port", "2"]
    assert parse_args(one_p_one_d).kv_ports_given == frozenset()
    assert parse_args([*one_p_one_d, "--prefill-kv-port", "9"]).kv_ports_given == {"/workers/prefill/a/1"}
    config = parse_args(["--prefill", "c:3:9", "--prefill", "d:4", "--decode", "e:5"])
    assert config.kv_ports_given == {"/workers/prefill/c/3"}
    with pytest.raises(ConfigError, match="--prefill-kv-port: port 0 is out of range"):
        parse_args([*one_p_one_d, "--prefill-kv-port", "0"])


def test_config_kv_protocol_drives_every_static_worker() -> None:
    config = parse_args(["--prefill", "a:1", "--decode", "c:3", "--decode", "d:4"])
    assert [w.kv_protocol for w in config.workers] == ["neuron"] * 3
    config = parse_args(["--prefill-ip", "a", "--prefill-port", "1", "--decode-ip", "b", "--decode-port", "2",
                         "--prefill", "c:3", "--decode", "d:4", "--kv-protocol", "nixl"])
    assert [(w.role, w.kv_protocol) for w in config.workers] == [
        ("prefill", "nixl"), ("decode", "nixl"), ("prefill", "nixl"), ("decode", "nixl")]
    assert parse_args(["--etcd", "e:1", "--kv-protocol", "neuron"]).workers == ()
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "a:1", "--decode", "c:3", "--kv-protocol", "mooncake"])


@pytest.mark.parametrize("argv,message", [
    ([], "no workers"),
    (["--prefill-ip", "a", "--prefill-port", "1"], "needs all of"),
    (["--prefill", "a:1"], "at least one prefill and one decode"),
    (["--prefill", "a", "--decode", "b:2"], "expected HOST:PORT"),
    (["--prefill", "a:x", "--decode", "b:2"], "not a number"),
    (["--prefill", "a:1", "--decode", "b:70000"], "out of range"),
    (["--etcd", "e:1", "--prefill", "a:1", "--decode", "b:2"], "not both"),
    (["--mode", "colocated", "--prefill", "a:1"], "takes --worker"),
    (["--worker", "a:1"], "is for --mode colocated"),
    (["--etcd", "e:1", "--read-timeout", "0"], "must be positive"),
    (["--etcd", "e:1", "--shutdown-grace", "-1"], "--shutdown-grace must be at least 0"),
    (["--prefill", "a:1", "--prefill", "a:1", "--decode", "b:2"], "given twice"),
    (["--etcd", "e:1", "--kv-protocol", "nixl"], "etcd records carry their own"),
    (["--mode", "colocated", "--worker", "w:1", "--kv-protocol", "nixl"], "is for static prefill/decode"),
])
def test_config_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def _record(role: str, server: str) -> WorkerRecord:
    return WorkerRecord(role=role, host="127.0.0.1", http_port=8000, server=server)


@pytest.mark.parametrize("endpoint, body, param", [
    (COMPLETIONS, {"model": "m", "prompt": "hi", "best_of": 3}, "best_of"),
    (COMPLETIONS, {"model": "m", "prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
     "add_special_tokens"),
])
def test_a_parameter_our_workers_do_not_serve_is_refused_before_any_leg(endpoint, body, param) -> None:
    request = parse_request(endpoint, json.dumps(body).encode(), disaggregated=True)
    ours = [_record("prefill", OUR_SERVER), _record("decode", OUR_SERVER)]
    with pytest.raises(BadRequest) as info:
        refuse_unserved(request, ours)
    assert info.value.param == param
    assert str(info.value).startswith(f"`{param}` is not supported by this server (accepted: ")
    # A vLLM server serves some of them, and a worker of unknown server answers for itself.
    refuse_unserved(request, [_record("prefill", OUR_SERVER), _record("decode", VLLM_SERVER)])
    refuse_unserved(request, [_record("prefill", OUR_SERVER), _record("decode", "")])
    refuse_unserved(request, [])


def test_neutral_values_of_unserved_parameters_pass() -> None:
    body = {"model": "m", "prompt": "hi", "best_of": 1, "use_beam_search": False, "tools": [], "add_special_tokens": True}
    request = parse_request(COMPLETIONS, json.dumps(body).encode(), disaggregated=True)
    refuse_unserved(request, [_record("prefill", OUR_SERVER), _record("decode", OUR_SERVER)])
