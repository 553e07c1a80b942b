"""neuron_connector: the worker's side of disaggregated inference.

Prefill workers serve KV lookups with a `SendBuffer`; decode workers pull with a
`RecvBuffer`; both register a `WorkerRecord` (common.worker_record) in etcd with a `Registration`, which the
proxy reads back and watches (`proxy.discovery.EtcdDiscovery`).

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
    recv.write_back(p_host, p_kv_port, WriteBack(...))   # a finished answer's KV, for the prefill to pull
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from common.errors import RegistrationError
from common.roles import DEFAULT_KV_PORT
from common.worker_record import WorkerRecord
from neuron_connector.errors import (
    ConnectorError, DuplicateRequest, EngineIdInUse, EngineMismatch, HandshakeError, IntegrityError,
    LayoutMismatch, PeerUnavailable, ProtocolError, PullTimeout, Unauthorized, UnknownRequest)
from neuron_connector.protocol import WriteBack
from neuron_connector.pulls import PullState, PullStatus
from neuron_connector.registry import Registration

if TYPE_CHECKING:
    from neuron_connector.recv_buffer import RecvBuffer
    from neuron_connector.send_buffer import SendBuffer
    from neuron_connector.send_stats import SendStats

# The buffers import torch (seconds): loaded on first use, so registering a worker (`Registration`) stays cheap.
_LAZY = {"RecvBuffer": "recv_buffer", "SendBuffer": "send_buffer", "SendStats": "send_stats"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)

__all__ = [
    "DEFAULT_KV_PORT",
    "ConnectorError", "DuplicateRequest", "EngineIdInUse", "EngineMismatch", "HandshakeError", "IntegrityError",
    "LayoutMismatch", "PeerUnavailable", "ProtocolError", "PullTimeout", "RegistrationError", "Unauthorized",
    "UnknownRequest",
    "PullState", "PullStatus", "RecvBuffer", "SendBuffer", "SendStats",
    "Registration", "WorkerRecord", "WriteBack",
]
