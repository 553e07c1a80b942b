"""Errors of the transfer engine.

    TransferError
    ├── LayoutMismatch      the peer's KV layout cannot hold our blocks
    ├── InvalidBlocks       a block id out of range, or src/dst lists of different length
    ├── TransferTimeout     the transfer did not complete in time
    ├── PeerLost            the peer closed, died or never answered
    ├── RegionNotRegistered the local or the peer's KV region is not (or no longer) registered
    ├── Unauthorized        the writer could not prove the shared KV secret to the listener
    ├── StaleHandoff        the receiver no longer holds the blocks for this handoff's generation
    └── BackendUnavailable  the backend cannot run on this machine (e.g. no torch-neuronx)
"""
from __future__ import annotations


class TransferError(Exception):
    """Base class of every error the transfer engine raises or reports on a token."""


class LayoutMismatch(TransferError):
    pass


class InvalidBlocks(TransferError):
    pass


class TransferTimeout(TransferError):
    pass


class PeerLost(TransferError):
    pass


class RegionNotRegistered(TransferError):
    pass


class Unauthorized(TransferError):
    pass


class BackendUnavailable(TransferError):
    pass


class StaleHandoff(TransferError):
    """The destination blocks are not (or no longer) open for the write's handoff generation
    (transfer.fences): nothing was written, or what was is discarded by the receiver."""
