"""CRC-32C of KV blocks, read in place from the pool (no copies).

A push's checksum covers exactly the bytes it moves, in the order they land: plane by
plane, and within a plane the blocks in ascending destination id. The sender's comes out
of the push itself (transports that copy compute it in the copy's pass, the others on the
peer's transfer thread); the receiver computes its own over its destination blocks, and
the two agree whenever every byte arrived.
"""
from __future__ import annotations

from typing import Sequence

from transfer.blocks import Run, local_ranges, plan_runs
from transfer.layout import KVLayout
from transfer.memcopy import crc32c_ranges
from transfer.region import Region


def runs_crc32c(region: Region, runs: Sequence[Run]) -> int:
    """CRC-32C of our blocks `runs` (run.local) in the order a push of them lands."""
    ranges = local_ranges(region.layout, runs)
    return crc32c_ranges(region.address, ranges.offsets, ranges.lengths)


def blocks_crc32c(region: Region, block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> int:
    """CRC-32C of the blocks `block_ids` of `region` as they land in `dst_block_ids` (pairwise).
    Raises InvalidBlocks on bad or repeated ids."""
    layout: KVLayout = region.layout
    # Destination ids were checked against the receiver's pool when the push was queued;
    # here they only order the blocks.
    runs = plan_runs(block_ids, dst_block_ids, layout.num_blocks, max(dst_block_ids, default=-1) + 1)
    return runs_crc32c(region, runs)
