"""The region of embedding rows in one process: its layout, the allocator of its slots, pushes between two."""
from __future__ import annotations

import pytest
import torch

from worker.multimodal.errors import RegionFull
from worker.multimodal.rows import BLOCK_BYTES, RowRegion, row_layout, rows_per_block


def test_blocks_are_runs_of_whole_rows_of_about_block_bytes() -> None:
    assert rows_per_block(256, torch.float32) == 64 and rows_per_block(4096, torch.bfloat16) == 8
    assert rows_per_block(100_000, torch.float32) == 2   # never less than one K and one V row
    layout = row_layout(256, torch.float32, 1000)
    assert layout.num_blocks == 16 and layout.block_bytes == BLOCK_BYTES


def test_slots_are_first_fit_runs_freed_and_merged_back() -> None:
    region = RowRegion("tcp", "127.0.0.1", 256, torch.float32, 64 * 8)
    try:
        a, b, c = region.reserve(64), region.reserve(65), region.reserve(1)
        assert [(s.first, s.count) for s in (a, b, c)] == [(0, 1), (1, 2), (3, 1)]
        assert b.rows.shape == (65, 256) and b.rows.is_contiguous()
        with pytest.raises(RegionFull, match="no room for 400 embedding rows: 256 of the region's 512 are free"):
            region.reserve(400)
        region.release(a)
        region.release(c)
        assert region.reserve(64).first == 0   # the first run that fits
        region.release(b)
        assert region.free_blocks == 7
        assert region.reserve(64 * 7).first == 1   # freed runs merge into one
    finally:
        region.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_push_lands_the_rows_in_the_peers_slot(transport: str) -> None:
    ours, theirs = (RowRegion(transport, "127.0.0.1", 256, torch.float32, 1024) for _ in range(2))
    try:
        theirs.reserve(100)   # the destination slot does not start at block 0
        src, dst = ours.reserve(130), theirs.reserve(130)
        src.rows.copy_(torch.randn(130, 256))
        ours.push(src, theirs.descriptor(), dst.first, timeout=10).wait(10)
        assert torch.equal(dst.rows, src.rows)
    finally:
        ours.close()
        theirs.close()
