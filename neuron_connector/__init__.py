"""neuron_connector: the worker's side of disaggregated inference.

Prefill workers serve KV lookups with a `SendBuffer`; decode workers pull with a
`RecvBuffer`; both register a `WorkerRecord` in etcd with a `Registration`, which the proxy
reads back and watches (`proxy.discovery.EtcdDiscovery`).

    # prefill
    # secret: bytes from common.kv_secret.resolve_secret, or None (unauthenticated)
    send = SendBuffer(engine, layout, engine_id, "127.0.0.1", kv_port, on_release=free_blocks,
                      secret=secret)
    send.start()
    send.publish(request_id, block_ids, first_token)       # prefill done; blocks stay pinned
    send.discard(request_id)                               # aborted

    # decode
    recv = RecvBuffer(engine, layout, engine_id=unique_id, on_finished=wake_engine,
                      secret=secret)   # one live session per engine id on each prefill peer
    recv.start()
    recv.request_pull(request_id, p_host, p_kv_port, dst_block_ids,
                      peer_engine_id=p_engine_id)          # optional: EngineMismatch if another answers
    recv.poll(request_id)        # PENDING | DONE(output_token) | FAILED(error), never blocks;
                                 # on_finished(request_id) says when it is no longer PENDING
    recv.cancel(request_id)      # True: blocks free now; False: poll until FAILED first;
                                 # either way the prefill peer is told to release the request
    recv.release(request_id, p_host, p_kv_port)   # a request never pulled is gone: same
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from common.roles import DEFAULT_KV_PORT
from neuron_connector.errors import (
    ConnectorError, DuplicateRequest, EngineIdInUse, EngineMismatch, HandshakeError, IntegrityError,
    LayoutMismatch, PeerUnavailable, ProtocolError, PullTimeout, RegistrationError, Unauthorized, UnknownRequest)
from neuron_connector.pulls import PullState, PullStatus
from neuron_connector.registry import Registration, WorkerRecord

# The buffers need the transfer engine (and torch); the proxy only needs records and
# registration, so they are imported on first use.
_LAZY = {"RecvBuffer": "neuron_connector.recv_buffer", "SendBuffer": "neuron_connector.send_buffer",
         "SendStats": "neuron_connector.send_buffer"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'neuron_connector' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from neuron_connector.recv_buffer import RecvBuffer
    from neuron_connector.send_buffer import SendBuffer, SendStats

__all__ = [
    "DEFAULT_KV_PORT",
    "ConnectorError", "DuplicateRequest", "EngineIdInUse", "EngineMismatch", "HandshakeError", "IntegrityError",
    "LayoutMismatch", "PeerUnavailable", "ProtocolError", "PullTimeout", "RegistrationError", "Unauthorized",
    "UnknownRequest",
    "PullState", "PullStatus", "RecvBuffer", "SendBuffer", "SendStats",
    "Registration", "WorkerRecord",
]
