"""The decode side's connection state to one prefill peer, sans I/O.

    NEW --send Handshake--> HANDSHAKE_SENT --HandshakeReply / send KVMapInit--> MAP_SENT
    MAP_SENT --KVMapReply--> READY        MAP_SENT --ErrorReply--> FAILED (LayoutMismatch ...)
    HANDSHAKE_SENT --ErrorReply--> FAILED (EngineIdInUse ...)
    any but FAILED --"handshake_required" (a new connection: either side restarted)--> NEW

Unanswered handshakes are resent every `resend_after` seconds: the peer may not be up yet.
Each handshake carries our engine id and a fresh client nonce. With a `secret`, our
kv_map_init proves we hold it, and the peer's KVMapReply must prove it back; a peer that
cannot, or that runs without a secret while we have one (or the reverse), fails the link
with Unauthorized (its kv_map_init still goes out, so the peer logs the refusal on its side).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from common.kv_secret import new_nonce, verify
from neuron_connector.errors import ConnectorError, EngineIdInUse, HandshakeError, LayoutMismatch, Unauthorized
from neuron_connector.protocol import (
    DECODE_PROOF, ENGINE_ID_IN_USE, LAYOUT_MISMATCH, PREFILL_PROOF, UNAUTHORIZED, ErrorReply, Handshake,
    HandshakeReply, KVMapInit, KVMapReply, handshake_proof)


class LinkState(enum.Enum):
    NEW = "new"
    HANDSHAKE_SENT = "handshake_sent"
    MAP_SENT = "map_sent"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a prefill peer told us in the handshake."""

    address: str
    engine_id: str
    transfer: dict[str, Any]
    kv_map: dict[str, Any]
    timestamp: float
    incarnation: str | None = None      # this life of the peer's signal plane (neuron_connector.incarnation)
    takes_write_backs: bool = False     # the peer pulls the answers' KV we offer it (`WriteBack`)


@dataclass
class PeerLink:
    """Handshake progress with the peer at `address` ("host:kv_port") as engine `engine_id`."""

    address: str
    engine_id: str                  # ours: one live session per id on the peer
    kv_map: dict[str, Any]          # our layout
    transfer: dict[str, Any]        # our transfer descriptor
    secret: bytes | None = field(default=None, repr=False)
    resend_after: float = 1.0
    incarnation: str | None = None  # ours, named in every handshake
    state: LinkState = LinkState.NEW
    error: ConnectorError | None = None
    info: PeerInfo | None = None
    _sent_at: float = 0.0
    _nonce: str = ""
    _hello: HandshakeReply | None = field(default=None, repr=False)

    def due(self, now: float) -> bytes | None:
        """The message to send now, if any (first handshake or a resend)."""
        if self.state is LinkState.NEW:
            self.state, self._nonce = LinkState.HANDSHAKE_SENT, new_nonce()
        elif self.state not in (LinkState.HANDSHAKE_SENT, LinkState.MAP_SENT):
            return None
        elif now - self._sent_at < self.resend_after:
            return None
        self._sent_at = now
        if self.state is LinkState.HANDSHAKE_SENT:
            return Handshake(self.engine_id, self._nonce, self.incarnation).to_bytes()
        return self._kv_map_init()

    def on_handshake(self, reply: HandshakeReply | ErrorReply, now: float) -> bytes | None:
        if self.state is not LinkState.HANDSHAKE_SENT:
            return None  # a late duplicate of an answered handshake
        if isinstance(reply, ErrorReply):
            kind = EngineIdInUse if reply.code == ENGINE_ID_IN_USE else HandshakeError
            self.fail(kind(f"prefill peer {self.address} refused our handshake as engine {self.engine_id!r}: "
                           f"{reply.message}"))
            return None
        self._hello = reply
        if reply.authenticated != (self.secret is not None):
            self.fail(Unauthorized(
                f"prefill peer {self.address} ({reply.engine_id}) requires the KV secret, and this decode "
                "worker has none (give it --kv-secret-file)" if reply.authenticated else
                f"prefill peer {self.address} ({reply.engine_id}) runs without the KV secret this decode "
                "worker has (give it the same --kv-secret-file)"))
            return self._kv_map_init()  # answered by a refusal, which the prefill worker logs too
        self.state, self._sent_at = LinkState.MAP_SENT, now
        return self._kv_map_init()

    def _kv_map_init(self) -> bytes:
        proof = None
        if self.secret is not None and self._hello is not None:
            proof = handshake_proof(self.secret, DECODE_PROOF, self._hello.nonce, self._nonce, self.engine_id)
        return KVMapInit(self.kv_map, self.transfer, proof).to_bytes()

    def on_kv_map(self, reply: KVMapReply | ErrorReply) -> None:
        if self.state is not LinkState.MAP_SENT or self._hello is None:
            return
        hello = self._hello
        if isinstance(reply, ErrorReply):
            kinds = {LAYOUT_MISMATCH: LayoutMismatch, UNAUTHORIZED: Unauthorized, ENGINE_ID_IN_USE: EngineIdInUse}
            what = {UNAUTHORIZED: "our proof of the KV secret",
                    ENGINE_ID_IN_USE: f"our engine id {self.engine_id!r}"}.get(reply.code, "our KV layout")
            self.fail(kinds.get(reply.code, HandshakeError)(
                f"prefill peer {self.address} refused {what}: {reply.message}"))
            return
        if self.secret is not None and not verify(self.secret, PREFILL_PROOF, reply.proof, hello.nonce,
                                                  self._nonce, self.engine_id):
            self.fail(Unauthorized(f"prefill peer {self.address} ({hello.engine_id}) failed to prove the KV "
                                   "secret (another secret file?): refused"))
            return
        self.info = PeerInfo(self.address, hello.engine_id, hello.transfer, reply.kv_map, hello.timestamp,
                             hello.incarnation, hello.takes_write_backs)
        self.state = LinkState.READY

    def reset(self) -> None:
        """The peer does not know this connection (either side restarted or reconnected):
        handshake again."""
        if self.state is not LinkState.FAILED:
            self.state, self._hello = LinkState.NEW, None

    def fail(self, error: ConnectorError) -> None:
        self.state, self.error = LinkState.FAILED, error

    @property
    def ready(self) -> bool:
        return self.state is LinkState.READY
