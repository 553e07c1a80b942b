"""The prefill ROUTER as a raw DEALER sees it: replies, errors, and serving on after errors."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
import zmq

from neuron_connector import PeerUnavailable, SendBuffer
from neuron_connector.protocol import Handshake, KVMapInit, LookupAll
from tests.neuron_connector.kv import LAYOUT, engine_with_pool, layout


@pytest.fixture
def prefill() -> Iterator[tuple[SendBuffer, Any]]:
    engine, _ = engine_with_pool("shm", seed=1)
    send = SendBuffer(engine, LAYOUT, "prefill-7", "127.0.0.1", 0, lambda rid: None)
    send.start()
    try:
        yield send, engine
    finally:
        send.close()
        engine.close()


@pytest.fixture
def dealer(prefill: tuple[SendBuffer, Any]) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{prefill[0].port}")
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


HELLO = Handshake("raw-decode", "n1").to_bytes()


def _ask(sock: zmq.Socket, payload: bytes) -> dict[str, Any]:
    """The reply to `payload`; probes (the prefill side checks its peers are still there) are skipped."""
    sock.send(payload)
    while (reply := json.loads(sock.recv())).get("type") == "probe":
        pass
    return reply


def test_handshake_reply_carries_engine_id_and_descriptor(prefill, dealer) -> None:
    send, engine = prefill
    reply = _ask(dealer, HELLO)
    assert reply["status"] == "ok" and reply["type"] == "handshake"
    assert reply["engine_id"] == "prefill-7" and reply["authenticated"] is False and len(reply["nonce"]) == 32
    assert reply["transfer"] == engine.descriptor()
    assert isinstance(reply["timestamp"], float)


@pytest.mark.parametrize("garbage, fragment", [
    (b"{oops", "not valid JSON"),
    (b'"just a string"', "JSON object"),
    (b'{"type": "warp"}', "unknown message type 'warp'"),
    (b'{"type": "lookup_all", "request_id": "r"}', "block_ids_in_peer_device"),
])
def test_bad_messages_get_an_error_and_the_socket_keeps_serving(prefill, dealer, garbage, fragment) -> None:
    reply = _ask(dealer, garbage)
    assert reply["status"] == "error" and fragment in reply["message"]
    assert _ask(dealer, HELLO)["status"] == "ok"
    assert prefill[0].stats.bad_messages == 1


def test_lookup_before_kv_map_init_requires_a_handshake(prefill, dealer) -> None:
    reply = _ask(dealer, LookupAll("r1", (0,)).to_bytes())
    assert reply["code"] == "handshake_required" and reply["request_id"] == "r1"
    assert reply["message"].endswith("has not completed the handshake")
    # A handshake alone does not establish the session: kv_map_init does.
    assert _ask(dealer, HELLO)["status"] == "ok"
    assert _ask(dealer, LookupAll("r1", (0,)).to_bytes())["code"] == "handshake_required"


def test_kv_map_init_before_a_handshake_requires_one(prefill, dealer) -> None:
    reply = _ask(dealer, KVMapInit(LAYOUT.to_dict(), {}).to_bytes())
    assert (reply["code"], reply["type"]) == ("handshake_required", "kv_map_init")


def test_kv_map_init_agrees_or_names_the_mismatch(prefill, dealer) -> None:
    d_engine, _ = engine_with_pool("shm")
    try:
        assert _ask(dealer, HELLO)["status"] == "ok"
        ok = _ask(dealer, KVMapInit(LAYOUT.to_dict(), d_engine.descriptor()).to_bytes())
        assert ok == {"type": "kv_map_init", "status": "ok", "kv_map": LAYOUT.to_dict()}
        # The peer is known now: an unpublished id is "not yet", not an error.
        assert _ask(dealer, LookupAll("r1", (0,)).to_bytes()) == {
            "type": "lookup_all", "request_id": "r1", "success": False}
        bad = _ask(dealer, KVMapInit(layout(block_size=8).to_dict(), d_engine.descriptor()).to_bytes())
        assert bad["status"] == "error" and bad["code"] == "layout_mismatch"
        assert "block_size: 4 != 8" in bad["message"]
        malformed = _ask(dealer, KVMapInit({"num_layers": 2}, {}).to_bytes())
        assert malformed["status"] == "error" and "malformed KV layout" in malformed["message"]
    finally:
        d_engine.close()


def test_replies_to_a_vanished_peer_are_dropped_and_serving_goes_on(prefill) -> None:
    send, _ = prefill
    ctx = zmq.Context()
    try:
        gone = ctx.socket(zmq.DEALER)
        gone.connect(f"tcp://127.0.0.1:{send.port}")
        for i in range(50):
            gone.send(Handshake("gone", f"n{i}").to_bytes())
        gone.close(linger=-1)     # delivered, then gone before any reply
        fresh = ctx.socket(zmq.DEALER)
        fresh.setsockopt(zmq.RCVTIMEO, 5000)
        fresh.connect(f"tcp://127.0.0.1:{send.port}")
        assert _ask(fresh, Handshake("fresh", "n-fresh").to_bytes())["status"] == "ok"
        fresh.close(linger=0)
    finally:
        ctx.term()


def test_taken_port_is_a_clear_error(prefill) -> None:
    send, engine = prefill
    clash = SendBuffer(engine, LAYOUT, "prefill-8", "127.0.0.1", send.port, lambda rid: None)
    with pytest.raises(PeerUnavailable, match=f"cannot bind the KV signal plane on 127.0.0.1:{send.port}"):
        clash.start()
    clash.close()
