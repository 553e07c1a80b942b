"""The sans-I/O handshake: the decode side's peer link and the prefill side's sessions, driven by hand."""
from __future__ import annotations

import pytest

from neuron_connector.errors import EngineIdInUse, HandshakeError, LayoutMismatch, Unauthorized
from neuron_connector.peer_link import LinkState, PeerLink
from neuron_connector.protocol import (
    DECODE_PROOF, ENGINE_ID_IN_USE, LAYOUT_MISMATCH, PREFILL_PROOF, UNAUTHORIZED, ErrorReply, Handshake,
    HandshakeReply, KVMapInit, KVMapReply, decode_request, handshake_proof)
from neuron_connector.sessions import SessionTable

SECRET = b"s3cret-shared-by-the-deployment"


class TestPeerLink:
    def _link(self, secret: bytes | None = None) -> PeerLink:
        return PeerLink("h:1", "d0", {"num_layers": 1}, {"engine_id": "d"}, secret, resend_after=1.0)

    def test_handshake_then_kv_map_then_ready(self) -> None:
        link = self._link()
        hello = decode_request(link.due(0))  # type: ignore[arg-type]
        assert isinstance(hello, Handshake) and hello.engine_id == "d0" and len(hello.nonce) == 32
        assert link.due(0.5) is None and decode_request(link.due(1.0)) == hello   # resent until answered
        kv_init = decode_request(link.on_handshake(HandshakeReply(5.0, "p0", {"engine_id": "p0"}, "s"), 1.1))
        assert isinstance(kv_init, KVMapInit) and kv_init.proof is None
        assert link.on_handshake(HandshakeReply(5.0, "p0", {}, "s"), 1.2) is None   # late duplicate
        link.on_kv_map(KVMapReply({"num_layers": 1}))
        assert link.ready and link.info is not None and link.info.engine_id == "p0"
        link.reset()
        again = decode_request(link.due(2))  # type: ignore[arg-type]
        assert isinstance(again, Handshake) and again.nonce != hello.nonce     # a fresh nonce per handshake

    @pytest.mark.parametrize("code, kind", [(LAYOUT_MISMATCH, LayoutMismatch), ("bad_request", HandshakeError),
                                            (UNAUTHORIZED, Unauthorized)])
    def test_refused_kv_map(self, code: str, kind: type) -> None:
        link = self._link()
        link.due(0)
        link.on_handshake(HandshakeReply(5.0, "p0", {}, "s"), 0.1)
        link.on_kv_map(ErrorReply("head_dim: 16 != 8", code, "kv_map_init"))
        assert link.state is LinkState.FAILED and type(link.error) is kind
        assert "h:1" in str(link.error) and "head_dim" in str(link.error)

    def test_an_engine_id_in_use_fails_the_link(self) -> None:
        link = self._link()
        link.due(0)
        link.on_handshake(ErrorReply("another live decode worker holds it", ENGINE_ID_IN_USE, "handshake"), 0.1)
        assert link.state is LinkState.FAILED and isinstance(link.error, EngineIdInUse)
        assert "'d0'" in str(link.error) and "h:1" in str(link.error)

    def test_both_sides_prove_the_secret_over_both_nonces(self) -> None:
        link = self._link(SECRET)
        client_nonce = decode_request(link.due(0)).nonce  # type: ignore[union-attr, arg-type]
        kv_init = decode_request(link.on_handshake(HandshakeReply(5.0, "p0", {}, "s1", True), 0.1))
        assert kv_init.proof == handshake_proof(SECRET, DECODE_PROOF, "s1", client_nonce, "d0")  # type: ignore
        # The prefill's proof of another session (a replay) is refused; its proof of this one is taken.
        replayed = handshake_proof(SECRET, PREFILL_PROOF, "s0", client_nonce, "d0")
        link.on_kv_map(KVMapReply({"num_layers": 1}, replayed))
        assert isinstance(link.error, Unauthorized) and "failed to prove the KV secret" in str(link.error)
        link = self._link(SECRET)
        client_nonce = decode_request(link.due(0)).nonce  # type: ignore[union-attr, arg-type]
        link.on_handshake(HandshakeReply(5.0, "p0", {}, "s1", True), 0.1)
        link.on_kv_map(KVMapReply({"num_layers": 1}, handshake_proof(SECRET, PREFILL_PROOF, "s1", client_nonce, "d0")))
        assert link.ready

    @pytest.mark.parametrize("ours, theirs, fragment", [
        (SECRET, False, "runs without the KV secret this decode worker has"),
        (None, True, "requires the KV secret, and this decode worker has none"),
    ])
    def test_a_secret_on_one_side_only_fails_the_link(self, ours: bytes | None, theirs: bool, fragment: str) -> None:
        link = self._link(ours)
        link.due(0)
        sent = link.on_handshake(HandshakeReply(5.0, "p0", {}, "s1", theirs), 0.1)
        assert isinstance(link.error, Unauthorized) and fragment in str(link.error) and "h:1 (p0)" in str(link.error)
        # Its kv_map_init still goes out (with a proof only if we hold a secret): the peer refuses it and logs that.
        init = decode_request(sent)
        assert isinstance(init, KVMapInit) and (init.proof is not None) == (ours is not None)
        assert link.due(5.0) is None  # failed: nothing more is sent


class TestSessionTable:
    def test_an_engine_id_is_bound_to_one_established_session(self) -> None:
        table = SessionTable()
        first = table.open(b"A", "d0", "c1")
        assert table.open(b"A", "d0", "c1") is first                  # a resent handshake keeps its nonce
        first = table.open(b"A", "d0", "c2")
        assert first.server_nonce != table.open(b"A", "d0", "c1").server_nonce
        # Opened but unproven: no session holds the id, so an unproven connection locks nobody out.
        assert table.established(b"A") is None and table.holder("d0", b"B") is None
        table.establish(table.get(b"A"), "t")  # type: ignore[arg-type]
        assert table.established(b"A") is not None
        assert table.holder("d0", b"A") is None and table.holder("d0", b"B") == b"A"
        table.drop(b"A")
        assert table.holder("d0", b"B") is None and table.routing_id_of("d0") is None
        table.establish(table.open(b"B", "d0", "c3"), "t")
        assert table.routing_id_of("d0") == b"B" and len(table) == 1
