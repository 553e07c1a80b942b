"""The index memory benchmark on a small index: removals empty it, the cap holds, the figures are there."""
from __future__ import annotations

from benchmarks.kv_index_memory import measure


def test_a_small_fill_is_measured_emptied_and_capped() -> None:
    out = measure(4096)
    assert out["blocks"] == 4096
    assert out["blocks_after_remove_all"] == 0
    assert out["blocks_with_cap_of_half"] == 2048
    assert out["bytes_per_block"] > 0 and out["blocks_per_s"] > 0
