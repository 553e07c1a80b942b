"""transfer: moves KV blocks between registered memory regions, asynchronously.

    engine = create_transfer_engine("auto")
    pool = engine.allocate_region(layout)          # the worker's KV pool tensor
    peer = engine.connect(peer_descriptor)         # descriptor() of the other side, as JSON
    token = engine.queue_transfer_with_token(peer, src_block_ids, dst_block_ids)
    token.is_done() / token.wait(timeout) / token.error

Backends: `shm` (same host, the pool in POSIX shared memory, one memcpy per chunk range),
`tcp` (one connection per peer, scatter-gather send, receive straight into the pool),
`nixl` (NIXL/UCX, optional extra), `neuron` (torch-neuronx only) and `auto` (neuron when
installed, else shm for same-host peers and tcp for the rest).

With a KV secret (`create_transfer_engine(..., secret=...)`) the tcp listener writes only
for writers that prove it; nixl cannot, so it is refused then.

A transfer queued with the receiver's handoff `generation` writes only into blocks the
receiver holds open for it (transfer.fences: shm and tcp; nixl writes are not fenced).
"""
from __future__ import annotations

from transfer.backend import Backend, Link
from transfer.blocks import Run, plan_runs
from transfer.engine import DEFAULT_TIMEOUT, TransferEngine
from transfer.errors import (BackendUnavailable, InvalidBlocks, LayoutMismatch, PeerLost,
                             RegionNotRegistered, StaleHandoff, TransferError, TransferTimeout, Unauthorized)
from transfer.factory import available_backends, create_transfer_engine
from transfer.layout import KVLayout
from transfer.token import CompletionToken

__all__ = [
    "KVLayout", "CompletionToken", "TransferEngine", "create_transfer_engine", "available_backends",
    "DEFAULT_TIMEOUT", "Backend", "Link", "Run", "plan_runs",
    "TransferError", "LayoutMismatch", "InvalidBlocks", "TransferTimeout", "PeerLost",
    "RegionNotRegistered", "BackendUnavailable", "Unauthorized", "StaleHandoff",
]
