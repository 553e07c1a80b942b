"""The prefill side's answers to a decode connection's Handshake and KVMapInit: how a session opens.

A Handshake opens the connection's session (sessions.SessionTable) for the engine id it names, unless another
live connection holds that id. Its kv_map_init establishes the session once the peer's proof of the KV secret
checks out (or neither side has a secret), its KV layout matches ours, and the transfer engine connected to it;
the reply carries our layout and, with a secret, our proof back. Every refusal is an ErrorReply naming why.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from neuron_connector.protocol import (
    BAD_REQUEST, ENGINE_ID_IN_USE, HANDSHAKE_REQUIRED, LAYOUT_MISMATCH, PREFILL_PROOF, UNAUTHORIZED, ErrorReply,
    Handshake, HandshakeReply, KVMapInit, KVMapReply, handshake_proof)
from neuron_connector.send_stats import SendStats
from neuron_connector.sessions import SessionTable, proof_refusal
from transfer import KVLayout, TransferError
from transfer import LayoutMismatch as TransferLayoutMismatch

log = logging.getLogger(__name__)


class SessionGate:
    """Opens and establishes the decode sessions of prefill `engine_id` (a SendBuffer's, on its thread): `alive(
    routing_id)` probes a connection, so that a gone one holds no engine id against its successor."""

    def __init__(self, sessions: SessionTable, transfer_engine: Any, layout: KVLayout, engine_id: str,
                 secret: bytes | None, stats: SendStats, alive: Callable[[bytes], bool]) -> None:
        self._sessions, self._engine, self._layout, self._engine_id = sessions, transfer_engine, layout, engine_id
        self._secret, self._stats, self._alive = secret, stats, alive

    def handshake(self, identity: bytes, message: Handshake, started_at: float, incarnation: str,
                  takes_write_backs: bool) -> HandshakeReply | ErrorReply:
        """Opens the connection's session, unless another live session holds the engine id."""
        self._sessions.drop_gone(self._alive, but=identity)
        if (refusal := self._engine_id_taken(identity, message.engine_id, Handshake.TYPE)) is not None:
            return refusal
        session = self._sessions.open(identity, message.engine_id, message.nonce, message.incarnation)
        return HandshakeReply(started_at, self._engine_id, self._engine.descriptor(), session.server_nonce,
                              authenticated=self._secret is not None, incarnation=incarnation,
                              takes_write_backs=takes_write_backs)

    def kv_map_init(self, identity: bytes, message: KVMapInit) -> KVMapReply | ErrorReply:
        """Establishes the connection's session, or names why not."""
        session = self._sessions.get(identity)
        if session is None:
            return ErrorReply(f"connection {identity.hex()} sent kv_map_init before a handshake",
                              HANDSHAKE_REQUIRED, KVMapInit.TYPE)
        refusal = proof_refusal(self._secret, self._engine_id, session, message.proof)
        if refusal is not None:
            self._stats.unauthorized += 1
            log.warning("refused %s: %s", session.describe(), refusal)
            return ErrorReply(refusal, UNAUTHORIZED, KVMapInit.TYPE)
        # Another connection of the same id may have proved itself since this one's handshake.
        if (refusal := self._engine_id_taken(identity, session.engine_id, KVMapInit.TYPE)) is not None:
            return refusal
        try:
            peer_layout = KVLayout.from_dict(message.kv_map)
            self._layout.check_compatible(peer_layout)
            self._sessions.establish(session, self._engine.connect(message.transfer))
        except TransferError as exc:
            code = LAYOUT_MISMATCH if isinstance(exc, TransferLayoutMismatch) else BAD_REQUEST
            return ErrorReply(f"kv_map_init refused by {self._engine_id}: {exc}", code, KVMapInit.TYPE)
        log.info("decode peer %s: KV blocks go over %s", session.engine_id,
                 self._engine.peer_backend(session.transfer_peer))
        proof = None if self._secret is None else handshake_proof(
            self._secret, PREFILL_PROOF, session.server_nonce, session.client_nonce, session.engine_id)
        return KVMapReply(self._layout.to_dict(), proof)

    def _engine_id_taken(self, identity: bytes, engine_id: str, reply_to: str) -> ErrorReply | None:
        """The refusal of connection `identity` as `engine_id` while another live session holds it."""
        holder = self._sessions.holder(engine_id, identity)
        if holder is None:
            return None
        self._stats.engine_id_conflicts += 1
        log.warning("refused connection %s as decode engine %r: another live connection (%s) holds that id",
                    identity.hex(), engine_id, holder.hex())
        return ErrorReply(f"prefill {self._engine_id} refused engine id {engine_id!r}: another live "
                          "decode worker holds it; give each decode worker a unique --engine-id",
                          ENGINE_ID_IN_USE, reply_to)
