"""CRC-32 of KV blocks, read in place from the pool (no copies).

A push's checksum covers exactly the bytes it moves, in the order they land: plane by
plane, and within a plane the blocks in ascending destination id. The sender computes it
over its source blocks, the receiver over its destination blocks, and the two agree
whenever every byte arrived. Adjacent blocks are read as one range, so the cost is that of
`zlib.crc32` over the bytes (it releases the GIL on large buffers).
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch

from transfer.blocks import local_ranges, plan_runs
from transfer.layout import KVLayout


def blocks_crc32(flat: torch.Tensor, layout: KVLayout, block_ids: Sequence[int],
                 dst_block_ids: Sequence[int]) -> int:
    """CRC-32 of the blocks `block_ids` of the pool `flat` (its bytes, uint8), as they land in
    `dst_block_ids` (pairwise). Raises InvalidBlocks on bad or repeated ids."""
    # Destination ids were checked against the receiver's pool when the push was queued;
    # here they only order the blocks.
    runs = plan_runs(block_ids, dst_block_ids, layout.num_blocks, max(dst_block_ids, default=-1) + 1)
    ranges = local_ranges(layout, runs)
    pool = memoryview(flat.numpy())
    crc = 0
    for offset, length in ranges.pairs():
        crc = zlib.crc32(pool[offset:offset + length], crc)
    return crc
