"""Test-only helpers: small KV layouts, real transfer engines, seeded pool contents, and a
corrupting shm transport."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence

import torch

from neuron_connector import PullState, PullStatus, RecvBuffer
from transfer import KVLayout, Link, Run, TransferEngine, create_transfer_engine
from transfer.blocks import remote_ranges
from transfer.engine import new_transfer_id
from transfer.region import Region, ShmSegment
from transfer.shm import ShmBackend

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)


def layout(**changes: int | str) -> KVLayout:
    return replace(LAYOUT, **changes)


def engine_with_pool(backend: str, kv_layout: KVLayout = LAYOUT, seed: int | None = None,
                     engine: TransferEngine | None = None):
    """A real transfer engine (or `engine`) and its registered pool: zeros, or seeded random values."""
    engine = engine or create_transfer_engine(backend, host="127.0.0.1")
    pool = engine.allocate_region(kv_layout)
    if seed is not None:
        pool.copy_(seeded(kv_layout, seed))
    return engine, pool


def seeded(kv_layout: KVLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(kv_layout.shape, generator=gen, dtype=torch.float32).to(kv_layout.torch_dtype)


def wait_terminal(recv: RecvBuffer, request_id: str, timeout: float = 30.0) -> PullStatus:
    """Polls until the pull is DONE or FAILED (poll itself never blocks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = recv.poll(request_id)
        if status.state is not PullState.PENDING:
            return status
        time.sleep(0.01)
    raise AssertionError(f"pull {request_id!r} still pending after {timeout}s")


class CorruptingLink(Link):
    """A corrupting link: stands in for memory or wire corruption that no machine here produces
    on demand. It writes through the real shm link, then, while its backend has corruptions
    left, flips one byte of the first destination block in the peer's pool."""

    def __init__(self, link: Link, peer_pool: ShmSegment, peer_layout: KVLayout,
                 backend: CorruptingShmBackend) -> None:
        self._link, self._peer_pool, self._layout, self._backend = link, peer_pool, peer_layout, backend

    def write(self, region: Region, runs: Sequence[Run], deadline: float, generation: int | None = None) -> None:
        self._link.write(region, runs, deadline, generation)
        self._corrupt(runs)

    def write_summed(self, region: Region, runs: Sequence[Run], deadline: float,
                     generation: int | None = None) -> int:
        checksum = self._link.write_summed(region, runs, deadline, generation)
        self._corrupt(runs)
        return checksum

    def _corrupt(self, runs: Sequence[Run]) -> None:
        if self._backend.take_corruption():
            offset = int(remote_ranges(self._layout, runs).offsets[0]) + 3
            self._peer_pool.pool_flat[offset] ^= 0x40

    def close(self) -> None:
        self._link.close()


class CorruptingShmBackend(ShmBackend):
    """The real shm transport whose first `corruptions` writes (over all its links) each land
    with one byte flipped (see CorruptingLink)."""

    def __init__(self, corruptions: int = 1) -> None:
        super().__init__()
        self.corruptions = corruptions

    def take_corruption(self) -> bool:
        if self.corruptions <= 0:
            return False
        self.corruptions -= 1
        return True

    def connect(self, descriptor: dict[str, Any], peer_layout: KVLayout, deadline: float) -> Link:
        link = super().connect(descriptor, peer_layout, deadline)
        peer_pool = ShmSegment(descriptor["transports"]["shm"]["segment"], peer_layout.total_bytes, create=False,
                               num_blocks=peer_layout.num_blocks)
        return CorruptingLink(link, peer_pool, peer_layout, self)


def corrupting_engine(corruptions: int = 1) -> TransferEngine:
    """A transfer engine over shm whose first `corruptions` pushes each land with one byte flipped."""
    return TransferEngine([CorruptingShmBackend(corruptions)], shm_pool=True, transfer_id=new_transfer_id())
