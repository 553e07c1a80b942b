"""A registered region of embedding rows: the transfer engine's pool, seen as [rows, hidden].

The transfer engine moves blocks of a KV layout. Laid out as vLLM's CPU order with one layer and
one head, head_dim = hidden and block_size = half a block's rows, a block is a run of whole rows,
next to each other in memory, and consecutive blocks are consecutive rows: any run of blocks is
a plain [n, hidden] slice of the region. Blocks hold about BLOCK_BYTES, so that a part's block
list stays short (the engine handles block ids one by one in Python) and little is lost at
the end of a part's last block.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from transfer import CompletionToken, KVLayout, create_transfer_engine
from transfer.layout import VLLM_CPU_ORDER
from worker.multimodal.errors import RegionFull

BLOCK_BYTES = 64 * 1024
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def rows_per_block(hidden_size: int, dtype: torch.dtype) -> int:
    """Rows in one block: an even number (K and V halves), about BLOCK_BYTES of them."""
    return 2 * max(1, BLOCK_BYTES // (2 * hidden_size * dtype.itemsize))


def row_layout(hidden_size: int, dtype: torch.dtype, num_rows: int) -> KVLayout:
    """The KV layout whose blocks are runs of rows_per_block embedding rows, holding at least `num_rows`."""
    per_block = rows_per_block(hidden_size, dtype)
    return KVLayout(num_layers=1, num_blocks=max(1, -(-num_rows // per_block)), block_size=per_block // 2,
                    num_kv_heads=1, head_dim=hidden_size, dtype=_DTYPE_NAMES[dtype], order=VLLM_CPU_ORDER)


def rows_in(megabytes: float, hidden_size: int, dtype: torch.dtype) -> int:
    """How many rows `megabytes` of region hold."""
    return int(megabytes * 2**20) // (hidden_size * dtype.itemsize)


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
        self.rows_per_block = rows_per_block(hidden_size, dtype)
        self._free: list[tuple[int, int]] = [(0, layout.num_blocks)]  # sorted (first, count) runs
        self._lock = threading.Lock()

    def blocks_for(self, num_rows: int) -> int:
        return max(1, -(-num_rows // self.rows_per_block))

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return sum(count for _, count in self._free)

    def reserve(self, num_rows: int) -> Slot:
        """A slot of `num_rows` rows; RegionFull when no free run is long enough."""
        need = self.blocks_for(num_rows)
        with self._lock:
            for i, (first, count) in enumerate(self._free):
                if count >= need:
                    self._free[i:i + 1] = [(first + need, count - need)] if count > need else []
                    start = first * self.rows_per_block
                    return Slot(first, need, self._rows[start:start + num_rows])
            free = sum(count for _, count in self._free) * self.rows_per_block
        raise RegionFull(f"no room for {num_rows} embedding rows: {free} of the region's "
                         f"{self.num_blocks * self.rows_per_block} are free, not enough in one run")

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
