"""A random one-layer paged KV pool and block tables, for the native attention kernels' tests."""
from __future__ import annotations

import torch


def pool_and_tables(lens: list[int], blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A random pool (2, blocks, block_size, kv_heads, head_dim) of `dtype` and scattered, 0-padded tables
    holding `lens` tokens."""
    gen = torch.Generator().manual_seed(seed)
    layer_kv = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    needed = [-(-n // block_size) for n in lens]
    ids = torch.randperm(blocks, generator=gen)[:sum(needed)].tolist()
    tables = torch.zeros(len(lens), max(needed), dtype=torch.int64)
    for row, n in enumerate(needed):
        tables[row, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    return layer_kv, tables
