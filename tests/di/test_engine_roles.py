"""The engine's DI roles in one process over shm: wake-ups instead of polling, held KV, and publish failures."""
from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest
import torch

from common.handoff import parse_leg
from stack.serving import free_port

from tests.helpers import wait_until
from worker import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from worker.engine.kv_connector import KVConnector, KVConnectorConfig
from worker.errors import OtherRoleError
from worker.server.protocol import error_for

NUM_BLOCKS = 64


def prefill_engine(**config: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(role="prefill", num_kv_blocks=NUM_BLOCKS, **config),
                     kv_connector=KVConnector(KVConnectorConfig("prefill", "shm", kv_port=free_port())))


@pytest.fixture()
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """A prefill and a decode engine; `indirect` parametrization gives both that max_num_seqs."""
    torch.set_num_threads(1)
    config = {"max_num_seqs": request.param} if hasattr(request, "param") else {}
    prefill = prefill_engine(**config)
    decode = LLMEngine(EngineConfig(role="decode", num_kv_blocks=NUM_BLOCKS, **config),
                       kv_connector=KVConnector(KVConnectorConfig("decode", "shm", engine_id="decode-roles")))
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_a_pending_pull_sleeps_until_the_connector_wakes_the_engine(pair) -> None:
    prefill, decode = pair
    woken = threading.Event()
    decode.kv_connector.wake = woken.set
    prompt, params = [40 + i % 50 for i in range(50)], SamplingParams(max_tokens=3, ignore_eos=True)
    decode.add_request("r", prompt, params, parse_leg({"role": "decode", "request_id": "r", "remote_host": "127.0.0.1",
                                                       "remote_port": prefill.kv_connector.kv_port}))
    assert decode.step() == []           # admitted: its pull started
    assert decode.wait_hint() is None    # nothing to poll: the RecvBuffer's thread will say when it ends
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1, ignore_eos=True), parse_leg({"role": "prefill"}))
    first = wait_until(prefill.step, timeout=30, what="the prefill leg's output")
    assert woken.wait(timeout=30), "the finished pull never woke the decode engine"
    outputs = decode.step()   # the pulled first token, then a decode step's second
    assert [(o.request_id, o.new_token_ids) for o in outputs][0] == ("r", first[0].new_token_ids)
    while decode.has_unfinished_requests() or prefill.has_unfinished_requests():
        decode.step()
        prefill.step()
    assert decode.stats().num_blocks_used == prefill.stats().num_blocks_used == 0


@pytest.mark.parametrize("pair", [1], indirect=True)
def test_kv_held_for_a_pull_to_come_does_not_stop_the_prefill_a_waiting_pull_needs(pair) -> None:
    """One slot each: the decode engine pulls A while B waits for its slot, and the prefill engine holds B's
    KV for that later pull. Held KV costs the prefill engine blocks, not its slot, so it prefills A too and
    both finish, well before A's pull timeout (30 s) would end the standoff with an error."""
    prefill, decode = pair
    prompts = {"A": [40 + i % 50 for i in range(50)], "B": [60 + i % 40 for i in range(50)]}
    params, leg = SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=1, ignore_eos=True)
    prefill.add_request("B", prompts["B"], leg, parse_leg({"role": "prefill", "request_id": "B"}))
    wait_until(prefill.step, timeout=30, what="B's prefill")
    for rid in "AB":
        decode.add_request(rid, prompts[rid], params, parse_leg({
            "role": "decode", "request_id": rid, "remote_host": "127.0.0.1",
            "remote_port": prefill.kv_connector.kv_port}))
    decode.step()
    assert (decode.stats().num_transferring, decode.stats().num_waiting) == (1, 1)   # A pulls, B waits
    prefill.add_request("A", prompts["A"], leg, parse_leg({"role": "prefill", "request_id": "A"}))
    tokens: dict[str, int] = {}
    errors: list[str] = []

    def both_finished() -> bool:
        prefill.step()
        for out in decode.step():
            errors.extend([out.error] if out.error else [])
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
        return not decode.has_unfinished_requests() and not prefill.has_unfinished_requests()
    wait_until(both_finished, timeout=20, what="both requests to finish")
    assert (tokens, errors) == ({"A": 3, "B": 3}, [])
    assert decode.stats().num_blocks_used == prefill.stats().num_blocks_used == 0


def test_a_signal_plane_that_cannot_publish_frees_the_blocks() -> None:
    prefill = prefill_engine()
    try:
        prefill.kv_connector.send.close()   # publish now raises ConnectorError: not serving
        prefill.add_request("p", [50] * 40, SamplingParams(max_tokens=1), parse_leg({"role": "prefill"}))
        outputs = prefill.step()
        assert [(o.request_id, o.finished) for o in outputs] == [("p", True)]
        assert prefill.stats().num_blocks_used == 0
        assert not prefill.has_unfinished_requests()
    finally:
        prefill.close()


def test_a_bug_in_publish_is_not_taken_for_a_transport_failure(monkeypatch) -> None:
    prefill = prefill_engine()
    try:
        def broken(*args: object) -> None:
            raise KeyError("a bug")
        monkeypatch.setattr(prefill.kv_connector, "publish", broken)
        prefill.add_request("p", [50] * 40, SamplingParams(max_tokens=1), parse_leg({"role": "prefill"}))
        with pytest.raises(KeyError, match="a bug"):
            prefill.step()
    finally:
        prefill.close()


def test_another_connectors_params_or_a_leg_with_another_shared_id_are_refused() -> None:
    prefill = prefill_engine()
    try:
        with pytest.raises(InvalidRequestError, match="kv_transfer_params.role is None but this worker serves role"):
            prefill.add_request("p", [50] * 40, SamplingParams(max_tokens=1), parse_leg({"do_remote_decode": True}))
        with pytest.raises(InvalidRequestError, match="kv_transfer_params.request_id 'other' is not"):
            prefill.add_request("p", [50] * 40, SamplingParams(max_tokens=1),
                                parse_leg({"role": "prefill", "request_id": "other"}))
        assert "p" not in prefill.requests and prefill.stats().num_waiting == 0
    finally:
        prefill.close()


def test_a_leg_of_the_other_role_is_refused_as_a_draining_worker_refuses_so_the_proxy_sends_it_on(pair) -> None:
    # The worker changed role between the proxy's pick and the leg's arrival: 503 worker_draining, not a 400.
    prefill, decode = pair
    legs = {"decode": {"role": "decode", "remote_host": "127.0.0.1", "remote_port": prefill.kv_connector.kv_port},
            "prefill": {"role": "prefill"}}
    for engine, other in ((prefill, "decode"), (decode, "prefill")):
        with pytest.raises(OtherRoleError, match=f"role is '{other}' but this worker serves role") as info:
            engine.add_request("r", [50] * 40, SamplingParams(max_tokens=2), parse_leg(legs[other]))
        status, body, headers = error_for(info.value)
        assert (status, body["error"]["type"], "Retry-After" in headers) == (503, "worker_draining", True)
        assert "r" not in engine.requests and engine.stats().num_waiting == 0
