"""Incarnations: who a signal-plane peer is in this life of its process.

Each SendBuffer and RecvBuffer draws a random incarnation when it starts and names it in its
handshake. A process restarted at the same address, even with the same engine id, is another
incarnation: a decode worker binds every pull to the prefill incarnation its first lookup went to
and fails the pull when another one answers there; a prefill worker refuses, terminally, a lookup
addressed to an incarnation that is not its own (it never had that request's KV).
"""
from __future__ import annotations

import secrets

from neuron_connector.protocol import STALE_INCARNATION, ErrorReply, LookupAll


def new_incarnation() -> str:
    return secrets.token_hex(8)


def stale_lookup(message: LookupAll, ours: str, engine_id: str) -> ErrorReply | None:
    """The refusal of a lookup addressed to another incarnation of this prefill engine, if it is."""
    if message.incarnation is None or message.incarnation == ours:
        return None
    return ErrorReply(f"lookup of {message.request_id!r} is addressed to incarnation {message.incarnation} of "
                      f"prefill {engine_id}, which restarted since (now {ours}) and never had its KV",
                      STALE_INCARNATION, LookupAll.TYPE, message.request_id)
