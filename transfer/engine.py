"""The transfer engine: one registered KV region, its transports, and connected peers.

Transfers are pushes: the prefill side, which owns the source blocks, queues a write into
the decode side's blocks. It learns completion from its own token and frees its blocks at
once; the decode side learns it from the one reply on the signal plane. With pulls, the
side that must free the blocks would only hear of completion through an extra message.
"""
from __future__ import annotations

import operator
import os
import threading
import time
import uuid
from typing import Any, Sequence

import torch

from transfer.backend import Backend
from transfer.blocks import local_ranges, plan_runs
from transfer.checksum import blocks_crc32c
from transfer.errors import InvalidBlocks, PeerLost, RegionNotRegistered, TransferError
from transfer.fences import Fences
from transfer.landing import LandedSum
from transfer.layout import KVLayout
from transfer.peer import Job, Peer
from transfer.region import SHM_PREFIX, Region, host_identity, reap_stale_segments
from transfer.token import CompletionToken

DEFAULT_TIMEOUT = 30.0


class TransferEngine:
    """Moves KV blocks between this process's registered pool and connected peers' pools.

    Thread-safe; `queue_transfer_with_token` never blocks on I/O. Transfers to one peer run
    in order on that peer's thread; different peers run in parallel.
    """

    def __init__(self, backends: Sequence[Backend], shm_pool: bool, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self.backends = list(backends)
        self._shm_pool = shm_pool
        self._lock = threading.RLock()
        self._region: Region | None = None
        self._peers: dict[str, Peer] = {}
        self._closed = False

    @property
    def backend(self) -> str:
        return "+".join(b.name for b in self.backends)

    # -- the local region -------------------------------------------------------------
    def allocate_region(self, layout: KVLayout) -> torch.Tensor:
        """A zeroed, pre-touched pool of `layout.shape`, registered (in shm when peers may map it)."""
        name = None
        if self._shm_pool:
            reap_stale_segments()   # pools of killed workers would otherwise fill /dev/shm
            name = f"{SHM_PREFIX}{self.transfer_id}-{uuid.uuid4().hex[:6]}"
        with self._lock:
            self._check_open()
            self._check_unregistered()
            self._bind(Region.allocate(layout, name))
            return self._region.tensor  # type: ignore[union-attr]

    def unregister_region(self) -> None:
        """Stops offering the pool; queued transfers fail with RegionNotRegistered."""
        with self._lock:
            region, self._region = self._region, None
            if region is None:
                return
            for backend in self.backends:
                backend.unbind()
            if region.segment is not None:
                region.segment.release()

    def _bind(self, region: Region) -> None:
        try:
            for backend in self.backends:
                backend.bind(region)
        except BaseException:
            for backend in self.backends:
                backend.unbind()
            if region.segment is not None:
                region.segment.release()
            raise
        self._region = region

    def _check_unregistered(self) -> None:
        if self._region is not None:
            raise TransferError("a region is already registered; unregister it first")

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the transfer engine is closed")

    # -- peers ------------------------------------------------------------------------
    def descriptor(self) -> dict[str, Any]:
        """JSON-serializable description a peer passes to `connect`."""
        with self._lock:
            if self._region is None:
                raise RegionNotRegistered("register or allocate a region before describing it")
            transports = {b.name: d for b in self.backends if (d := b.describe()) is not None}
            return {"transfer_id": self.transfer_id, "backend": self.backend, "host_id": host_identity(),
                    "pid": os.getpid(), "layout": self._region.layout.to_dict(), "transports": transports}

    def connect(self, descriptor: dict[str, Any]) -> str:
        """Connects to the peer that produced `descriptor`; returns its peer id.

        Raises LayoutMismatch if its blocks cannot hold ours, PeerLost if no transport of
        ours reaches it. The link itself opens on the first transfer.
        """
        with self._lock:
            self._check_open()
            if self._region is None:
                raise RegionNotRegistered("register or allocate a region before connecting")
            layout = KVLayout.from_dict(descriptor.get("layout", {}))
            self._region.layout.check_compatible(layout)
            peer_id = str(descriptor.get("transfer_id", ""))
            if peer_id in self._peers:
                return peer_id
            backend = next((b for b in self.backends if b.reaches(descriptor)), None)
            if backend is None or not peer_id:
                raise PeerLost(f"no transport of {self.backend!r} reaches peer {peer_id!r} "
                               f"(offers {sorted(descriptor.get('transports', {}))})")
            self._peers[peer_id] = Peer(
                peer_id, backend.name, layout,
                open_link=lambda deadline: backend.connect(descriptor, layout, deadline),
                current_region=lambda: self._region)
            return peer_id

    def peer_backend(self, peer: str) -> str:
        """Name of the transport used for `peer`."""
        return self._peer(peer).backend_name

    def disconnect(self, peer: str) -> None:
        with self._lock:
            handle = self._peers.pop(peer, None)
        if handle is not None:
            handle.close()

    def _peer(self, peer: str) -> Peer:
        handle = self._peers.get(peer)
        if handle is None:
            raise PeerLost(f"unknown or disconnected peer {peer!r}")
        return handle

    # -- transfers --------------------------------------------------------------------
    def queue_transfer_with_token(self, peer: str, src_block_ids: Sequence[int],
                                  dst_block_ids: Sequence[int], token: CompletionToken | None = None,
                                  timeout: float = DEFAULT_TIMEOUT, checksum: bool = False,
                                  generation: int | None = None) -> CompletionToken:
        """Queues a copy of our blocks src into the peer's blocks dst; returns its token at once.

        With the peer's handoff `generation`, bytes land only in blocks the peer holds open for it
        (transfer.fences); otherwise the token ends with StaleHandoff.

        With `checksum`, the token's `checksum` is the CRC-32C of the bytes sent, as the
        receiver's `checksum(dst)` sums them (computed by the transfer, never by the caller's
        thread). Every failure, including bad ids, ends the token with a typed error.
        """
        token = token if token is not None else CompletionToken()
        token._arm(time.monotonic() + timeout)
        try:
            # Submitting under the lock orders the job before any disconnect's stop signal.
            with self._lock:
                handle, region = self._peer(peer), self._region
                if region is None:
                    raise RegionNotRegistered("no local region is registered")
                runs = plan_runs(_ints(src_block_ids), _ints(dst_block_ids),
                                 region.layout.num_blocks, handle.layout.num_blocks)
                if runs:
                    handle.submit(Job(token, region, runs, checksum, generation))
                else:
                    token._finish(None, 0 if checksum else None)  # nothing to move: a prompt served from cache
        except TransferError as exc:
            token._finish(exc)
        return token

    @property
    def fences(self) -> Fences | None:
        """The handoff fences of our pool (transfer.fences); None without a pool or the native module."""
        region = self._region
        return None if region is None else region.fences

    def checksum(self, block_ids: Sequence[int], dst_block_ids: Sequence[int] | None = None) -> int:
        """CRC-32C of our blocks `block_ids` as a push lays them into the peer's `dst_block_ids`
        (default: the same ids), so a sender's checksum of its source blocks equals the
        receiver's of its destination blocks when every byte arrived (transfer.checksum).
        Reads every byte: call it off any thread that must stay responsive.

        Raises RegionNotRegistered without a pool, InvalidBlocks for bad ids.
        """
        region = self._region
        if region is None:
            raise RegionNotRegistered("no local region is registered")
        ids = _ints(block_ids)
        return blocks_crc32c(region, ids, ids if dst_block_ids is None else _ints(dst_block_ids))

    def follow_landing(self, block_ids: Sequence[int]) -> LandedSum:
        """The checksum of our blocks `block_ids`, summed as a push lands them (transfer.landing):
        call right after opening them for the handoff, before its writer may start. Without
        landing marks (no native module) it sums everything at `finish`.

        Raises RegionNotRegistered without a pool, InvalidBlocks for bad ids.
        """
        region = self._region
        if region is None:
            raise RegionNotRegistered("no local region is registered")
        ids = _ints(block_ids)
        runs = plan_runs(ids, ids, region.layout.num_blocks, region.layout.num_blocks)
        marks = region.marks if ids else None
        return LandedSum(region, marks, local_ranges(region.layout, runs), min(ids, default=0))

    def close(self) -> None:
        """Disconnects every peer, stops transports and frees the region; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for handle in peers:
            handle.close()
        self.unregister_region()
        for backend in self.backends:
            backend.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def new_transfer_id() -> str:
    return f"{uuid.uuid4().hex[:12]}-{os.getpid()}"


def _ints(ids: Sequence[int]) -> list[int]:
    """Plain ints from any integer type (numpy, torch scalars); bools are not block ids."""
    try:
        if any(isinstance(b, bool) for b in ids):
            raise TypeError("bool is not a block id")
        return [operator.index(b) for b in ids]
    except TypeError as exc:
        raise InvalidBlocks(f"block ids must be integers: {exc}") from exc

