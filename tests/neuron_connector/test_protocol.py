from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neuron_connector.errors import ProtocolError
from neuron_connector.protocol import (
    CRC32C, HANDSHAKE_REQUIRED, ErrorReply, Handshake, HandshakeReply, KVMapInit, KVMapReply, LookupAll,
    LookupReply, Probe, Release, decode_reply, decode_request, request_fields)

LAYOUT = {"num_layers": 2, "num_blocks": 8, "block_size": 4, "num_kv_heads": 2, "head_dim": 8,
          "dtype": "float32"}


@pytest.mark.parametrize("message", [
    Handshake("d0", "n1"),
    Handshake("d0", "n1", incarnation="5f0c"),
    KVMapInit(LAYOUT, {"engine_id": "d0", "transports": {"tcp": {"port": 1}}}),
    KVMapInit(LAYOUT, {}, proof="ab12"),
    LookupAll("req-1", (3, 0, 7)),
    LookupAll("req-1", (3,), timeout_s=2.5),
    LookupAll("req-1", (3,), timeout_s=2.5, checksum=CRC32C),
    LookupAll("req-1", (3,), skipped_blocks=0),
    LookupAll("req-1", (8, 9), timeout_s=1.0, skipped_blocks=5),
    LookupAll("req-1", (3,), traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    LookupAll("req-1", (3,), generation=2**61 - 1, incarnation="5f0c"),
    Release("req-1"),
    Release("req-1", pulled=True),
])
def test_requests_round_trip(message: object) -> None:
    assert decode_request(message.to_bytes()) == message  # type: ignore[attr-defined]


@pytest.mark.parametrize("message", [
    HandshakeReply(1234.5, "p0", {"engine_id": "p0"}, "n2"),
    HandshakeReply(1234.5, "p0", {}, "n2", authenticated=True),
    HandshakeReply(1234.5, "p0", {}, "n2", incarnation="a1b2"),
    HandshakeReply(1234.5, "p0", {}, "n2", takes_write_backs=True),
    KVMapReply(LAYOUT),
    KVMapReply(LAYOUT, proof="cd34"),
    Probe(),
    LookupReply("req-1", False),
    LookupReply("req-1", False, error="aborted"),
    LookupReply("req-1", True, 42, (5, 6)),
    LookupReply("req-1", True, 42, (5, 6), checksum=0),
    LookupReply("req-1", True, 42, (5, 6), checksum=2**32 - 1),
    LookupReply("req-1", True, 42, (5, 6), generation=1),
    LookupReply("req-1", False, error="gone", generation=3),
    ErrorReply("no", HANDSHAKE_REQUIRED, "lookup_all", "req-1"),
    ErrorReply("bad json"),
])
def test_replies_round_trip(message: object) -> None:
    assert decode_reply(message.to_bytes()) == message  # type: ignore[attr-defined]


def test_wire_format_matches_the_design() -> None:
    assert json.loads(Handshake("d0", "n1").to_bytes()) == {"type": "handshake", "engine_id": "d0", "nonce": "n1"}
    assert json.loads(LookupAll("r", (1, 2)).to_bytes()) == {
        "type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [1, 2]}
    assert json.loads(LookupReply("r", True, 9, (1, 2)).to_bytes()) == {
        "type": "lookup_all", "request_id": "r", "success": True, "output_token": 9,
        "block_ids_in_peer_device": [1, 2]}
    assert json.loads(LookupReply("r", False).to_bytes()) == {
        "type": "lookup_all", "request_id": "r", "success": False}
    assert json.loads(Release("r").to_bytes()) == {"type": "release", "request_id": "r"}
    assert json.loads(Release("r", pulled=True).to_bytes()) == {"type": "release", "request_id": "r", "pulled": True}
    assert json.loads(LookupAll("r", (1,), checksum="crc32c").to_bytes())["checksum"] == "crc32c"
    assert json.loads(LookupAll("r", (1,), skipped_blocks=3).to_bytes())["skipped_blocks"] == 3
    assert json.loads(LookupReply("r", True, 9, (1,), checksum=0xDEADBEEF).to_bytes())["checksum"] == 0xDEADBEEF
    hello = json.loads(HandshakeReply(1.0, "p0", {}, "n2").to_bytes())
    assert hello["status"] == "ok" and hello["timestamp"] == 1.0 and hello["engine_id"] == "p0"
    assert (hello["nonce"], hello["authenticated"]) == ("n2", False)
    assert "takes_write_backs" not in hello   # a peer that takes none says nothing: older decode peers read it so
    assert json.loads(HandshakeReply(1.0, "p0", {}, "n2", takes_write_backs=True).to_bytes())["takes_write_backs"]
    assert "proof" not in json.loads(KVMapInit(LAYOUT, {}).to_bytes())
    assert json.loads(ErrorReply("boom").to_bytes())["status"] == "error"


@pytest.mark.parametrize("data, fragment", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b'{"type": "teleport"}', "unknown message type 'teleport'"),
    (b'{"no_type": 1}', "unknown message type None"),
    (b'{"type": "lookup_all", "block_ids_in_peer_device": [1]}', "lacks field 'request_id'"),
    (b'{"type": "lookup_all", "request_id": "", "block_ids_in_peer_device": [1]}', "must not be empty"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [1, -2]}', "non-negative"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [true]}', "non-negative"),
    (b'{"type": "lookup_all", "request_id": 7, "block_ids_in_peer_device": []}', "must be"),
    (b'{"type": "kv_map_init", "kv_map": [], "transfer": {}}', "'kv_map' must be"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [], "timeout_s": 0}',
     "'timeout_s' must be positive"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [], "generation": 0}',
     "'generation' must be in"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [], "checksum": "md5"}',
     "'checksum' must be one of \\['crc32c'\\], got 'md5'"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [], "checksum": true}',
     "'checksum' must be"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [], "skipped_blocks": -1}',
     "'skipped_blocks' must not be negative"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [], "skipped_blocks": 1.5}',
     "'skipped_blocks' must be"),
    (b'{"type": "lookup_all", "request_id": "r", "block_ids_in_peer_device": [], "skipped_blocks": true}',
     "'skipped_blocks' must be"),
    (b'{"type": "release"}', "lacks field 'request_id'"),
    (b'{"type": "release", "request_id": ""}', "must not be empty"),
    (b'{"type": "release", "request_id": ["r"]}', "must be"),
    (b'{"type": "handshake"}', "lacks field 'engine_id'"),
    (b'{"type": "handshake", "engine_id": "", "nonce": "n"}', "'engine_id' must not be empty"),
    (b'{"type": "handshake", "engine_id": "d", "nonce": 5}', "'nonce' must be"),
    (b'{"type": "kv_map_init", "kv_map": {}, "transfer": {}, "proof": 1}', "'proof' must be"),
])
def test_bad_requests_raise_protocol_error(data: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment.replace("(", r"\(")):
        decode_request(data)


def test_bad_replies_raise_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="unknown reply type"):
        decode_reply(b'{"type": "lookup"}')
    with pytest.raises(ProtocolError, match="output_token"):
        decode_reply(b'{"type": "lookup_all", "request_id": "r", "success": true, "output_token": true,'
                     b' "block_ids_in_peer_device": []}')


@pytest.mark.parametrize("checksum, fragment", [
    ("-1", "32-bit unsigned"), (str(2**32), "32-bit unsigned"), ('"abc"', "must be"), ("true", "got a bool"),
    ("1.5", "must be")])
def test_bad_reply_checksums_raise_protocol_error(checksum: str, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        decode_reply(b'{"type": "lookup_all", "request_id": "r", "success": true, "output_token": 1,'
                     b' "block_ids_in_peer_device": [], "checksum": ' + checksum.encode() + b"}")


def test_request_fields_reads_what_it_can() -> None:
    assert request_fields(b'{"type": "lookup_all", "request_id": "r9"}') == ("lookup_all", "r9")
    assert request_fields(b'{"type": 3}') == (None, None)
    assert request_fields(b"garbage") == (None, None)


ids = st.text(min_size=1, max_size=40)
blocks = st.lists(st.integers(min_value=0, max_value=2**31), max_size=64).map(tuple)


@given(ids, blocks, st.none() | st.floats(min_value=0.001, max_value=1e6))
def test_lookup_round_trips_for_any_id_and_blocks(rid: str, block_ids: tuple, timeout: float | None) -> None:
    message = LookupAll(rid, block_ids, timeout)
    assert decode_request(message.to_bytes()) == message


@given(ids)
def test_release_round_trips_for_any_id(rid: str) -> None:
    assert decode_request(Release(rid).to_bytes()) == Release(rid)


@given(ids, st.booleans(), st.integers(min_value=-2**40, max_value=2**40), blocks)
def test_lookup_reply_round_trips(rid: str, success: bool, token: int, block_ids: tuple) -> None:
    message = LookupReply(rid, True, token, block_ids) if success else LookupReply(rid, False, error=rid)
    assert decode_reply(message.to_bytes()) == message


@given(st.binary(max_size=200) | st.from_regex(rb'\{"type": ?"(lookup_all|kv_map_init|handshake|release)".{0,60}\}'))
def test_arbitrary_bytes_decode_or_raise_protocol_error_only(data: bytes) -> None:
    for decode in (decode_request, decode_reply):
        try:
            decode(data)
        except ProtocolError:
            pass


def test_a_lookup_reply_without_a_first_token_round_trips() -> None:
    """A vLLM prefill worker publishes before it knows its first token (its decode peer samples it again)."""
    reply = LookupReply("r", True, None, (3, 4))
    assert decode_reply(reply.to_bytes()) == reply
