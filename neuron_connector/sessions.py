"""The prefill side's decode sessions, sans I/O: one per signal-plane connection.

The ROUTER gives every connection its own routing id; a Handshake on it opens a session
naming a decode engine id, and the session is established once its kv_map_init was
accepted (with a KV secret: once its proof checked out). Lookups and releases count only
from established sessions. An engine id is bound to one established session at a time, and
only then: a connection that has proved nothing cannot hold an id against its rightful
owner. The owner drops the sessions whose connection is gone, then asks `holder` before
`open` and `establish`, and refuses the newcomer while another session holds its id.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from common.kv_secret import new_nonce, verify
from neuron_connector.protocol import DECODE_PROOF


@dataclass
class Session:
    """One decode connection: its engine id, both nonces of its handshake, and once
    established the transfer engine's peer id for its pool."""

    routing_id: bytes
    engine_id: str
    client_nonce: str
    server_nonce: str
    transfer_peer: str | None = None
    incarnation: str | None = None   # this life of the decode worker's signal plane, as its handshake names it

    @property
    def established(self) -> bool:
        return self.transfer_peer is not None

    def describe(self) -> str:
        return f"decode engine {self.engine_id!r} (connection {self.routing_id.hex()})"


class SessionTable:
    """Sessions by routing id, and the session each engine id is bound to; not thread-safe.
    `on_bound(engine_id)` is called when an engine id gets bound, `on_unbound(engine_id, now)` when
    its session went and no other holds it (a decode worker of ours gone, or reconnecting); `on_bound` is
    given the incarnation the session's handshake named too."""

    def __init__(self, on_bound: Callable[[str, str | None], None] = lambda engine_id, incarnation: None,
                 on_unbound: Callable[[str, float], None] = lambda engine_id, now: None) -> None:
        self._sessions: dict[bytes, Session] = {}
        self._bound: dict[str, bytes] = {}
        self._on_bound, self._on_unbound = on_bound, on_unbound

    def get(self, routing_id: bytes) -> Session | None:
        return self._sessions.get(routing_id)

    def name(self, routing_id: bytes) -> str:
        """The connection's session described for a log line, or the connection's id."""
        session = self._sessions.get(routing_id)
        return session.describe() if session is not None else f"connection {routing_id.hex()}"

    def established(self, routing_id: bytes) -> Session | None:
        session = self._sessions.get(routing_id)
        return session if session is not None and session.established else None

    def holder(self, engine_id: str, routing_id: bytes) -> bytes | None:
        """The routing id of another session bound to `engine_id`, if any."""
        other = self._bound.get(engine_id)
        return None if other == routing_id else other

    def open(self, routing_id: bytes, engine_id: str, client_nonce: str, incarnation: str | None = None) -> Session:
        """(Re)starts the connection's session as `engine_id` (in its life `incarnation`) with a fresh server
        nonce; a resent handshake of the same attempt (same client nonce) keeps the one it was given."""
        session = self._sessions.get(routing_id)
        if session is not None and (session.engine_id, session.client_nonce) == (engine_id, client_nonce):
            return session
        self.drop(routing_id)
        session = self._sessions[routing_id] = Session(routing_id, engine_id, client_nonce, new_nonce(),
                                                       incarnation=incarnation)
        return session

    def establish(self, session: Session, transfer_peer: str) -> None:
        """The session proved itself: it may pull, and its engine id is bound to it. Call only
        when `holder(session.engine_id, session.routing_id)` is None."""
        session.transfer_peer = transfer_peer
        self._bound[session.engine_id] = session.routing_id
        self._on_bound(session.engine_id, session.incarnation)

    def drop(self, routing_id: bytes) -> Session | None:
        """Forgets the connection's session (its peer is gone, or it starts anew)."""
        session = self._sessions.pop(routing_id, None)
        if session is not None and self._bound.get(session.engine_id) == routing_id:
            del self._bound[session.engine_id]
            self._on_unbound(session.engine_id, time.monotonic())
        return session

    def routing_ids(self) -> list[bytes]:
        return list(self._sessions)

    def drop_gone(self, alive: Callable[[bytes], bool], but: bytes | None = None) -> None:
        """Forgets the sessions whose connection is gone (a decode worker that reconnected, restarted
        or vanished), so their engine ids are free again; `alive(routing_id)` probes one (with
        ROUTER_MANDATORY a send to a gone routing id fails at once, while a full queue means the peer
        is alive; probing every session, at each handshake and twice a second while requests wait
        for their puller, is cheap)."""
        for routing_id in self.routing_ids():
            if routing_id != but and not alive(routing_id):
                self.drop(routing_id)

    def routing_id_of(self, engine_id: str) -> bytes | None:
        return self._bound.get(engine_id)

    def __len__(self) -> int:
        return len(self._sessions)


def proof_refusal(secret: bytes | None, engine_id: str, session: Session, proof: str | None) -> str | None:
    """Why prefill `engine_id` refuses the session's proof of the KV secret, or None when it accepts it."""
    peer = f"decode engine {session.engine_id!r}"
    if secret is None:
        return None if proof is None else (
            f"{peer} proves a KV secret, but prefill {engine_id} has none (give both --kv-secret-file)")
    if proof is None:
        return f"{peer} sent no proof of the KV secret that prefill {engine_id} requires (give it --kv-secret-file)"
    if not verify(secret, DECODE_PROOF, proof, session.server_nonce, session.client_nonce, session.engine_id):
        return f"{peer} failed to prove the KV secret of prefill {engine_id} (another secret file?)"
    return None
