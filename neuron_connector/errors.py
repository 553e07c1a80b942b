"""Errors of the KV connector.

    ConnectorError
    ├── ProtocolError       a signal-plane message that is not valid JSON or not a known message
    ├── HandshakeError      the prefill peer refused or never answered the handshake
    │   ├── LayoutMismatch  the two KV layouts cannot exchange blocks (the prefill side's
    │   │                   transfer.LayoutMismatch, carried back over the signal plane)
    │   ├── EngineMismatch  the peer's handshake names another engine than the pull expects
    │   │                   (e.g. another prefill worker restarted on that address)
    │   ├── Unauthorized    a side could not prove the shared KV secret, or only one side has one
    │   └── EngineIdInUse   another live decode session holds our engine id on that prefill peer
    ├── PullTimeout         the prefill peer had no finished request for the id before the deadline
    ├── IntegrityError      the blocks a pull received do not match the checksum the prefill peer sent
    ├── PeerUnavailable     the prefill peer could not be reached
    ├── UnknownRequest      a request id this side does not know
    └── DuplicateRequest    a request id that is already published or already being pulled

Registering a worker in etcd raises common.errors.RegistrationError, as reading a malformed record does.
"""
from __future__ import annotations


class ConnectorError(Exception):
    """Base class of every error the connector raises."""


class ProtocolError(ConnectorError):
    pass


class HandshakeError(ConnectorError):
    pass


class LayoutMismatch(HandshakeError):
    pass


class EngineMismatch(HandshakeError):
    pass


class Unauthorized(HandshakeError):
    pass


class EngineIdInUse(HandshakeError):
    pass


class PullTimeout(ConnectorError):
    pass


class IntegrityError(ConnectorError):
    pass


class PeerUnavailable(ConnectorError):
    pass


class UnknownRequest(ConnectorError):
    pass


class DuplicateRequest(ConnectorError):
    pass
