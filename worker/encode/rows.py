"""A registered region of embedding rows: the transfer engine's pool, seen as [rows, hidden].

The transfer engine moves blocks of a KV layout. Laid out as vLLM's CPU order with one
layer, one head, one token per block and head_dim = hidden, a block is two whole rows, next
to each other in memory, and consecutive blocks are consecutive rows: any run of blocks is
a plain [n, hidden] slice of the region.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from transfer import CompletionToken, KVLayout, create_transfer_engine
from transfer.layout import VLLM_CPU_ORDER
from worker.encode.errors import RegionFull

ROWS_PER_BLOCK = 2
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def row_layout(hidden_size: int, dtype: torch.dtype, num_rows: int) -> KVLayout:
    """The KV layout whose blocks are pairs of embedding rows."""
    return KVLayout(num_layers=1, num_blocks=max(1, -(-num_rows // ROWS_PER_BLOCK)), block_size=1,
                    num_kv_heads=1, head_dim=hidden_size, dtype=_DTYPE_NAMES[dtype], order=VLLM_CPU_ORDER)


def rows_in(megabytes: float, hidden_size: int, dtype: torch.dtype) -> int:
    """How many rows `megabytes` of region hold (at least one block's)."""
    return max(ROWS_PER_BLOCK, int(megabytes * 2**20) // (hidden_size * dtype.itemsize))


def blocks_for(num_rows: int) -> int:
    return -(-num_rows // ROWS_PER_BLOCK)


@dataclass(frozen=True, slots=True)
class Slot:
    """Blocks [first, first + count) of a region, holding `rows` (a view of its first num_rows rows)."""

    first: int
    count: int
    rows: torch.Tensor


class RowRegion:
    """Rows of `hidden_size` in `dtype`, registered with a transfer engine of `transport`.

    Thread-safe. Rows are handed out as contiguous slots, first fit, and merged back when freed.
    """

    def __init__(self, transport: str, host: str, hidden_size: int, dtype: torch.dtype, capacity_rows: int,
                 secret: bytes | None = None) -> None:
        self.hidden_size, self.dtype = hidden_size, dtype
        self.engine = create_transfer_engine(transport, host, secret)
        try:
            layout = row_layout(hidden_size, dtype, capacity_rows)
            self._rows = self.engine.allocate_region(layout).view(-1, hidden_size)
        except BaseException:
            self.engine.close()
            raise
        self.num_blocks = layout.num_blocks
        self._free: list[tuple[int, int]] = [(0, layout.num_blocks)]  # sorted (first, count) runs
        self._lock = threading.Lock()

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return sum(count for _, count in self._free)

    def reserve(self, num_rows: int) -> Slot:
        """A slot of `num_rows` rows; RegionFull when no free run is long enough."""
        need = blocks_for(max(num_rows, 1))
        with self._lock:
            for i, (first, count) in enumerate(self._free):
                if count >= need:
                    self._free[i:i + 1] = [(first + need, count - need)] if count > need else []
                    start = first * ROWS_PER_BLOCK
                    return Slot(first, need, self._rows[start:start + num_rows])
            free = sum(count for _, count in self._free) * ROWS_PER_BLOCK
        raise RegionFull(f"no room for {num_rows} embedding rows: {free} of the region's "
                         f"{self.num_blocks * ROWS_PER_BLOCK} are free, not enough in one run")

    def release(self, slot: Slot) -> None:
        with self._lock:
            runs = sorted(self._free + [(slot.first, slot.count)])
            merged: list[tuple[int, int]] = []
            for first, count in runs:
                if merged and merged[-1][0] + merged[-1][1] == first:
                    merged[-1] = (merged[-1][0], merged[-1][1] + count)
                else:
                    merged.append((first, count))
            self._free = merged

    def descriptor(self) -> dict:
        return self.engine.descriptor()

    def push(self, slot: Slot, descriptor: dict, first_block: int, timeout: float) -> CompletionToken:
        """Queues a copy of `slot` into blocks from `first_block` of the peer that sent `descriptor`."""
        peer = self.engine.connect(descriptor)
        return self.engine.queue_transfer_with_token(
            peer, range(slot.first, slot.first + slot.count), range(first_block, first_block + slot.count),
            timeout=timeout)

    def close(self) -> None:
        self.engine.close()
