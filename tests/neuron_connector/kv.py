"""Test-only helpers: small KV layouts, real transfer engines, seeded pool contents, and a
corrupting shm transport."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator, Sequence

import torch

from neuron_connector import PullState, PullStatus, RecvBuffer
from transfer import KVLayout, Link, Run, TransferEngine, create_transfer_engine
from transfer.blocks import local_ranges
from transfer.checksum import runs_crc32c
from transfer.engine import new_transfer_id
from transfer.region import Region
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
    on demand. While its backend has corruptions left, a write lands one byte of the first
    destination block flipped, as a transport that delivered a wrong byte would: the byte is
    flipped in the source for the copy only, and a checked write reports the checksum of the
    true source. The receiver may check bytes as they land, so the flip happens before they do."""

    def __init__(self, link: Link, backend: CorruptingShmBackend) -> None:
        self._link, self._backend = link, backend

    def write(self, region: Region, runs: Sequence[Run], deadline: float, generation: int | None = None) -> None:
        with self._corrupted(region, runs):
            self._link.write(region, runs, deadline, generation)

    def write_summed(self, region: Region, runs: Sequence[Run], deadline: float,
                     generation: int | None = None) -> int:
        checksum = runs_crc32c(region, runs)
        with self._corrupted(region, runs):
            self._link.write_summed(region, runs, deadline, generation)
        return checksum

    @contextmanager
    def _corrupted(self, region: Region, runs: Sequence[Run]) -> Iterator[None]:
        if not self._backend.take_corruption():
            yield
            return
        offset = int(local_ranges(region.layout, runs).offsets[0]) + 3
        region.flat[offset] ^= 0x40
        try:
            yield
        finally:
            region.flat[offset] ^= 0x40

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
        return CorruptingLink(super().connect(descriptor, peer_layout, deadline), self)


def corrupting_engine(corruptions: int = 1) -> TransferEngine:
    """A transfer engine over shm whose first `corruptions` pushes each land with one byte flipped."""
    return TransferEngine([CorruptingShmBackend(corruptions)], shm_pool=True, transfer_id=new_transfer_id())
