"""Incarnations: who a signal-plane peer is in this life of its process.

Each SendBuffer and RecvBuffer draws a random incarnation when it starts and names it in its
handshake. A process restarted at the same address, even with the same engine id, is another
incarnation: a decode worker binds every pull to the prefill incarnation its first lookup went to
and fails the pull when another one answers there; a prefill worker refuses, terminally, a lookup
addressed to an incarnation that is not its own (it never had that request's KV), and frees the
blocks it holds for a decode engine's old incarnation as soon as its new one has a session, never
handing them to the new one.
"""
from __future__ import annotations

import secrets

from neuron_connector.protocol import STALE_INCARNATION, ErrorReply, LookupAll


def new_incarnation() -> str:
    return secrets.token_hex(8)


def stale_lookup(message: LookupAll, ours: str, engine_id: str, decode_engine: str = "",
                 bound: str | None = None) -> ErrorReply | None:
    """The refusal of a lookup addressed to another incarnation of this prefill engine, or (`bound`: the
    incarnation of `decode_engine` its request is held for, when not the asking one) of a request held for
    another life of the decode engine asking, if it is either."""
    if bound is not None:
        return ErrorReply(f"request {message.request_id!r} was held for incarnation {bound} of decode engine "
                          f"{decode_engine!r}, which restarted since; its blocks are freed, not handed over",
                          STALE_INCARNATION, LookupAll.TYPE, message.request_id)
    if message.incarnation is None or message.incarnation == ours:
        return None
    return ErrorReply(f"lookup of {message.request_id!r} is addressed to incarnation {message.incarnation} of "
                      f"prefill {engine_id}, which restarted since (now {ours}) and never had its KV",
                      STALE_INCARNATION, LookupAll.TYPE, message.request_id)
