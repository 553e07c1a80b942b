"""Test-only helpers: small KV layouts, real transfer engines, seeded pool contents."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from neuron_connector import PullState, PullStatus, RecvBuffer
from transfer import KVLayout, create_transfer_engine

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)


def layout(**changes: int | str) -> KVLayout:
    return replace(LAYOUT, **changes)


def engine_with_pool(backend: str, kv_layout: KVLayout = LAYOUT, seed: int | None = None):
    """A real transfer engine and its registered pool: zeros, or seeded random values."""
    engine = create_transfer_engine(backend, host="127.0.0.1")
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
