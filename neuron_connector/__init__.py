"""neuron_connector: the worker's side of disaggregated inference.

Prefill workers serve KV lookups with a `SendBuffer`; decode workers pull with a
`RecvBuffer`; both register in etcd with a `Registration`; the proxy reads them back with
`list_workers`.
"""
from __future__ import annotations

from neuron_connector.errors import (
    ConnectorError, DuplicateRequest, HandshakeError, LayoutMismatch, PeerUnavailable,
    ProtocolError, PullTimeout, RegistrationError, UnknownRequest)
from neuron_connector.peer_link import PeerInfo
from neuron_connector.pulls import PullState, PullStatus
from neuron_connector.recv_buffer import RecvBuffer
from neuron_connector.registry import (
    Registration, WorkerRecord, list_workers, list_workers_async)
from neuron_connector.send_buffer import SendBuffer, SendStats

DEFAULT_KV_PORT = 14579

__all__ = [
    "DEFAULT_KV_PORT",
    "ConnectorError", "DuplicateRequest", "HandshakeError", "LayoutMismatch", "PeerUnavailable",
    "ProtocolError", "PullTimeout", "RegistrationError", "UnknownRequest",
    "PeerInfo", "PullState", "PullStatus", "RecvBuffer", "SendBuffer", "SendStats",
    "Registration", "WorkerRecord", "list_workers", "list_workers_async",
]
