"""The decode side's connection state to one prefill peer, sans I/O.

    NEW --send Handshake--> HANDSHAKE_SENT --HandshakeReply / send KVMapInit--> MAP_SENT
    MAP_SENT --KVMapReply--> READY        MAP_SENT --ErrorReply--> FAILED (LayoutMismatch ...)
    READY --"handshake_required" (the peer restarted)--> NEW

Unanswered handshakes are resent every `resend_after` seconds: the peer may not be up yet.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from neuron_connector.errors import ConnectorError, HandshakeError, LayoutMismatch
from neuron_connector.protocol import (
    LAYOUT_MISMATCH, ErrorReply, Handshake, HandshakeReply, KVMapInit, KVMapReply)


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


@dataclass
class PeerLink:
    """Handshake progress with the peer at `address` ("host:kv_port")."""

    address: str
    kv_map: dict[str, Any]          # our layout
    transfer: dict[str, Any]        # our transfer descriptor
    resend_after: float = 1.0
    state: LinkState = LinkState.NEW
    error: ConnectorError | None = None
    info: PeerInfo | None = None
    _sent_at: float = 0.0
    _hello: HandshakeReply | None = field(default=None, repr=False)

    def due(self, now: float) -> bytes | None:
        """The message to send now, if any (first handshake or a resend)."""
        if self.state is LinkState.NEW:
            self.state = LinkState.HANDSHAKE_SENT
        elif self.state not in (LinkState.HANDSHAKE_SENT, LinkState.MAP_SENT):
            return None
        elif now - self._sent_at < self.resend_after:
            return None
        self._sent_at = now
        if self.state is LinkState.HANDSHAKE_SENT:
            return Handshake().to_bytes()
        return KVMapInit(self.kv_map, self.transfer).to_bytes()

    def on_handshake(self, reply: HandshakeReply, now: float) -> bytes | None:
        if self.state is not LinkState.HANDSHAKE_SENT:
            return None  # a late duplicate of an answered handshake
        self._hello, self.state, self._sent_at = reply, LinkState.MAP_SENT, now
        return KVMapInit(self.kv_map, self.transfer).to_bytes()

    def on_kv_map(self, reply: KVMapReply | ErrorReply) -> None:
        if self.state is not LinkState.MAP_SENT or self._hello is None:
            return
        if isinstance(reply, ErrorReply):
            kind = LayoutMismatch if reply.code == LAYOUT_MISMATCH else HandshakeError
            self.fail(kind(f"prefill peer {self.address} refused our KV layout: {reply.message}"))
            return
        hello = self._hello
        self.info = PeerInfo(self.address, hello.engine_id, hello.transfer, reply.kv_map, hello.timestamp)
        self.state = LinkState.READY

    def reset(self) -> None:
        """The peer forgot us (it restarted): handshake again."""
        if self.state is LinkState.READY:
            self.state, self._hello = LinkState.NEW, None

    def fail(self, error: ConnectorError) -> None:
        self.state, self.error = LinkState.FAILED, error

    @property
    def ready(self) -> bool:
        return self.state is LinkState.READY
