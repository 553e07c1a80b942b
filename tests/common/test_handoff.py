"""The handoff's wire format: each type's dict is the one vLLM's connector conventions and our proxy
exchange, it parses back to the same value, and each bad key is named in one error type."""
from __future__ import annotations

import json

import pytest

from common.handoff import (DecodeParams, ForeignParams, HandoffError, PrefillHandoff, PrefillParams,
                            QueuedDecodeParams, nixl_prefill_params, parse_leg, queued_leg)

DECODE = {"role": "decode", "request_id": "u1", "remote_host": "10.0.0.1", "remote_port": 14600,
          "remote_engine_id": "p-1", "remote_url": "http://10.0.0.1:8100"}


@pytest.mark.parametrize("value", [
    PrefillParams(), PrefillParams("u1"), PrefillParams("u1", pulled_on_stop=False),
    DecodeParams("10.0.0.1", 14600), DecodeParams("10.0.0.1", 14600, "u1", "p-1", "http://10.0.0.1:8100"),
])
def test_legs_round_trip_through_their_dicts_and_json(value) -> None:
    assert parse_leg(json.loads(json.dumps(value.to_dict()))) == value
    assert type(value).parse(value.to_dict()) == value


def test_the_dicts_are_the_wire_format_key_for_key_in_order() -> None:
    assert json.dumps(PrefillParams("u1").to_dict()) == '{"role": "prefill", "request_id": "u1"}'
    assert PrefillParams("u1", pulled_on_stop=False).to_dict() == {"role": "prefill", "request_id": "u1",
                                                                   "pulled_on_stop": False}
    assert list(DecodeParams.parse(DECODE).to_dict().items()) == list(DECODE.items())
    assert DecodeParams("h", 1).to_dict() == {"role": "decode", "remote_host": "h", "remote_port": 1}
    assert DecodeParams.parse({**DECODE, "remote_url": "http://10.0.0.1:8100/"}).remote_url == "http://10.0.0.1:8100"
    assert nixl_prefill_params() == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_a_prefill_answers_handoff_round_trips_and_may_say_nothing() -> None:
    shown = {"remote_host": "10.0.0.1", "remote_port": 14600, "remote_engine_id": "p-1", "request_id": "u1"}
    handoff = PrefillHandoff.parse(shown)
    assert handoff == PrefillHandoff("10.0.0.1", 14600, "p-1", "u1") and handoff.to_dict() == shown
    assert PrefillHandoff.parse({}) == PrefillHandoff() and PrefillHandoff().to_dict() == {}
    # vLLM's NixlConnector answers carry other keys beside these: they are not ours to judge.
    assert PrefillHandoff.parse({"remote_block_ids": [1], "remote_host": "h"}) == PrefillHandoff("h")


def test_params_without_a_role_are_another_connectors_kept_as_they_came() -> None:
    foreign = parse_leg(nixl_prefill_params())
    assert foreign == ForeignParams(nixl_prefill_params()) and foreign.role is None
    assert foreign.to_dict() == nixl_prefill_params() and parse_leg({}) == ForeignParams({})


@pytest.mark.parametrize("obj,key,message", [
    ("peer", None, "kv_transfer_params must be an object, got 'peer'"),
    ({"role": "both"}, "role", "kv_transfer_params.role must be 'prefill' or 'decode', got 'both'"),
    ({"role": "prefill", "request_id": 7}, "request_id", "kv_transfer_params.request_id must be a string, got 7"),
    ({"role": "prefill", "pulled_on_stop": 0}, "pulled_on_stop",
     "kv_transfer_params.pulled_on_stop must be true or false, got 0"),
    ({**DECODE, "remote_host": ""}, "remote_host", "kv_transfer_params.remote_host must be a non-empty string"),
    ({"role": "decode", "remote_port": 1}, "remote_host", "kv_transfer_params.remote_host must be a non-empty string"),
    ({**DECODE, "remote_port": True}, "remote_port", "kv_transfer_params.remote_port must be a TCP port, got True"),
    ({**DECODE, "remote_port": 65536}, "remote_port", "kv_transfer_params.remote_port must be a TCP port, got 65536"),
    ({"role": "decode", "remote_host": "h"}, "remote_port",
     "kv_transfer_params.remote_port must be a TCP port, got None"),
    ({**DECODE, "remote_engine_id": ""}, "remote_engine_id",
     "kv_transfer_params.remote_engine_id must be a non-empty string"),
    ({**DECODE, "remote_engine_id": 7}, "remote_engine_id",
     "kv_transfer_params.remote_engine_id must be a non-empty string"),
    ({**DECODE, "remote_url": "10.0.0.1:8100"}, "remote_url",
     "kv_transfer_params.remote_url must be an http(s) URL, got '10.0.0.1:8100'"),
])
def test_each_bad_leg_names_its_key(obj, key: str | None, message: str) -> None:
    with pytest.raises(HandoffError) as info:
        parse_leg(obj)
    assert (info.value.key, str(info.value)) == (key, message)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("parse,obj,key", [
    (PrefillParams.parse, DECODE, "role"),
    (DecodeParams.parse, {"role": "prefill"}, "role"),
    (ForeignParams.parse, {"role": "prefill"}, "role"),
    (PrefillHandoff.parse, {"remote_port": "14600"}, "remote_port"),
    (PrefillHandoff.parse, {"remote_host": 1}, "remote_host"),
    (PrefillHandoff.parse, {"request_id": ["u"]}, "request_id"),
    (PrefillHandoff.parse, None, None),
])
def test_each_type_refuses_what_is_not_its_own(parse, obj, key: str | None) -> None:
    with pytest.raises(HandoffError) as info:
        parse(obj)
    assert info.value.key == key


def test_a_queued_decode_leg_names_its_request_and_becomes_a_decode_leg_once_taken() -> None:
    leg = QueuedDecodeParams("u1")
    assert json.dumps(leg.to_dict()) == '{"role": "decode", "request_id": "u1", "prefill_queue": true}'
    assert queued_leg(json.loads(json.dumps(leg.to_dict()))) == leg
    assert queued_leg(DECODE) is None and queued_leg({"role": "prefill", "prefill_queue": True}) is None
    assert leg.pull_from("h", 1, "u1-take2", "p-1") == DecodeParams("h", 1, "u1-take2", "p-1")
    for obj, key in (({"role": "decode", "prefill_queue": 1, "request_id": "u"}, "prefill_queue"),
                     ({"role": "decode", "prefill_queue": True}, "request_id")):
        with pytest.raises(HandoffError) as info:
            queued_leg(obj)
        assert info.value.key == key
