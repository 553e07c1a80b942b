"""The request flows' sans-I/O parts: which flow a request takes, the handoff between its legs, the
command line, and the prefill-first flow driven with in-memory legs (the forwarder's boundary)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from common.handoff import DecodeParams
from proxy import COMPLETIONS, ConfigError, UpstreamProtocol, WorkerRecord, parse_args, parse_request
from proxy.flows import DecodeLeg, concurrent, decode_first, decode_first_body, flow_for, neuron_handoff, prefill_first
from proxy.requests import ClientRequest
from worker.errors import RemotePrefillError
from worker.server.protocol import error_for

STATIC = ["--prefill-ip", "10.0.0.1", "--prefill-port", "8100", "--decode-ip", "10.0.0.2", "--decode-port", "8200"]
PREFILL = WorkerRecord("prefill", "10.0.0.1", 8100, kv_port=14600, engine_id="p-1")
DECODE = WorkerRecord("decode", "10.0.0.2", 8200)
NAMED_DECODE = WorkerRecord("decode", "10.0.0.2", 8200, engine_id="d-1")
NIXL_PREFILL = WorkerRecord("prefill", "10.0.0.3", 8100, kv_protocol="nixl")


def _request(**body: Any) -> ClientRequest:
    base = {"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0}
    return parse_request(COMPLETIONS, json.dumps({**base, **body}).encode(), disaggregated=True)


def test_strategy_flag_defaults_to_concurrent_and_colocated_ignores_it() -> None:
    assert parse_args(STATIC).strategy == "concurrent"
    assert parse_args([*STATIC, "--disaggregation-strategy", "decode_first"]).strategy == "decode_first"
    colocated = parse_args(["--mode", "colocated", "--worker", "10.0.0.5:8000",
                            "--disaggregation-strategy", "prefill_first"])
    assert colocated.colocated


def test_bad_strategy_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        parse_args([*STATIC, "--disaggregation-strategy", "decode-first"])
    assert stop.value.code == 2
    assert "argument --disaggregation-strategy: invalid choice: 'decode-first'" in capsys.readouterr().err
    with pytest.raises(ConfigError):  # the other checks still apply
        parse_args(["--disaggregation-strategy", "prefill_first"])


@pytest.mark.parametrize("strategy, flow", [("concurrent", concurrent), ("prefill_first", prefill_first),
                                            ("decode_first", decode_first)])
def test_neuron_workers_take_the_strategys_flow_nixl_workers_always_prefill_first(strategy: str, flow: Any) -> None:
    assert flow_for(strategy, PREFILL) is flow
    assert flow_for(strategy, NIXL_PREFILL) is prefill_first


def test_decode_first_body_names_the_prefill_workers_http_api_and_signal_plane() -> None:
    body = decode_first_body(_request(stream=True), "u1", 7, PREFILL)
    assert body["kv_transfer_params"] == {"role": "decode", "request_id": "u1", "remote_host": "10.0.0.1",
                                          "remote_port": 14600, "remote_engine_id": "p-1",
                                          "remote_url": "http://10.0.0.1:8100"}
    assert body["seed"] == 7 and body["stream"] is True and body["max_tokens"] == 5


def test_neuron_handoff_is_where_prefills_answer_says_its_blocks_wait() -> None:
    shown = {"remote_host": "10.9.9.9", "remote_port": 15000, "remote_engine_id": "p-2", "request_id": "u1"}
    assert neuron_handoff({"kv_transfer_params": shown}, "u1", PREFILL) == {"role": "decode", **shown}
    wildcard = {**shown, "remote_host": "0.0.0.0"}
    assert neuron_handoff({"kv_transfer_params": wildcard}, "u1", PREFILL)["remote_host"] == "10.0.0.1"
    silent = neuron_handoff({}, "u1", PREFILL)  # a vllm serve with NeuronConnector: the worker's record
    assert silent == {"role": "decode", "request_id": "u1", "remote_host": "10.0.0.1", "remote_port": 14600,
                      "remote_engine_id": "p-1"}
    with pytest.raises(UpstreamProtocol, match="name request 'u2', not 'u1'"):
        neuron_handoff({"kv_transfer_params": {**shown, "request_id": "u2"}}, "u1", PREFILL)
    with pytest.raises(UpstreamProtocol, match="answer's kv_transfer_params.remote_port must be a TCP port"):
        neuron_handoff({"kv_transfer_params": {**shown, "remote_port": "15000"}}, "u1", PREFILL)


class _Legs:
    """In-memory legs: prefill answers `answer`; decode legs are recorded, never sent."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def call(self, worker: WorkerRecord, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
        self.sent.append((worker.role, body))
        return json.dumps(self.answer).encode()

    def start_decode(self, worker: WorkerRecord, request: ClientRequest, body: dict[str, Any],
                     headers: dict[str, str], took: object = None) -> DecodeLeg:
        self.sent.append((worker.role, body))
        return DecodeLeg(worker, asyncio.ensure_future(asyncio.sleep(0)))


@pytest.mark.parametrize("finish, decoded", [("length", True), ("stop", False)])
def test_prefill_first_starts_decode_with_prefills_handoff_unless_its_token_ended_the_answer(
        finish: str, decoded: bool) -> None:
    answer = {"choices": [{"text": "x", "finish_reason": finish}],
              "kv_transfer_params": {"remote_host": "10.0.0.1", "remote_port": 14600, "request_id": "u1"}}
    legs = _Legs(answer)

    async def run() -> tuple[dict[str, Any], DecodeLeg | None]:
        return await prefill_first(legs, _request(), PREFILL, NAMED_DECODE, "u1", None)  # type: ignore[arg-type]

    first, leg = asyncio.run(run())
    assert first == answer and (leg is not None) == decoded
    # No decode_engine_id: the decode leg, sent once prefill answered, may go to another decode worker (this one
    # changed role meanwhile), and prefill would release blocks named for this one once its session went.
    assert legs.sent[0] == ("prefill", {**_request().body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "role": "prefill", "request_id": "u1", "pulled_on_stop": False}})
    if decoded:
        assert legs.sent[1][1]["kv_transfer_params"] == {"role": "decode", "request_id": "u1",
                                                         "remote_host": "10.0.0.1", "remote_port": 14600,
                                                         "remote_engine_id": "p-1"}


def test_decode_workers_remote_prefill_url_and_its_failure_statuses() -> None:
    leg = {"role": "decode", "remote_host": "10.0.0.1", "remote_port": 14600}
    assert DecodeParams.parse({**leg, "remote_url": "http://10.0.0.1:8100/"}).remote_url == "http://10.0.0.1:8100"
    assert DecodeParams.parse(leg).remote_url is None
    with pytest.raises(ValueError, match="remote_url must be an http"):
        DecodeParams.parse({**leg, "remote_url": "10.0.0.1:8100"})
    status, body, headers = error_for(RemotePrefillError("remote prefill ... on prefill worker X failed"))
    assert (status, body["error"]["type"], headers) == (502, "kv_transfer_error", {})
    status, _, headers = error_for(RemotePrefillError("... answered HTTP 503", retryable=True))
    assert status == 503 and headers == {"Retry-After": "1"}


def test_decode_first_sends_one_leg_to_decode_naming_the_prefill_worker_and_no_prefill_answer() -> None:
    legs = _Legs({})
    request = _request(stream=True)
    first, leg = asyncio.run(decode_first(legs, request, PREFILL, DECODE, "u1", 7))  # type: ignore[arg-type]
    assert first is None and leg is not None and leg.worker == DECODE
    assert legs.sent == [("decode", decode_first_body(request, "u1", 7, PREFILL))]
