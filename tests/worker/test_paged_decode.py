"""The native decode attention: SDPA's numbers, read straight from the paged pool."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.paged_pool import pool_and_tables
from worker.model.layers import paged_decode

needs_native = pytest.mark.skipif(not paged_decode.NATIVE, reason="worker.model.layers._paged_decode is not built")

BLOCKS, BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM = 40, 4, 2, 3, 32


def reference(q_group: torch.Tensor, layer_kv: torch.Tensor, tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Per sequence: its context copied out of the pool, then SDPA in fp32."""
    rows = []
    for q, table, n in zip(q_group.float(), tables, lens):
        kv = layer_kv[:, table].flatten(1, 2)[:, :n].transpose(1, 2).float()       # (2, kv_heads, n, d)
        rows.append(F.scaled_dot_product_attention(q.unsqueeze(0), kv[0:1], kv[1:2])[0])
    return torch.stack(rows)


@needs_native
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])   # 48: the plain loops even where AVX-512 is
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[1], [7, 13, 4, 9], [12, 12], [37, 16, 5]],
                         ids=["one-token", "ragged", "equal", "past-16"])
def test_native_decode_attention_equals_sdpa_over_the_gathered_context(lens: list[int], dtype: torch.dtype,
                                                                       head_dim: int, portable: bool) -> None:
    layer_kv, tables = pool_and_tables(lens, BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim, dtype=dtype)
    q_group = torch.randn(len(lens), KV_HEADS, GROUP, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = paged_decode.decode_attention(q_group, layer_kv, tables, torch.tensor(lens), max(lens), portable)
    expected = reference(q_group, layer_kv, tables, lens)
    assert out.shape == q_group.shape and out.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(out, expected, atol=1e-5, rtol=0), (out - expected).abs().max()
    else:   # fp32 throughout, rounded to bf16 once: within one bf16 step of the fp32 answer
        assert torch.allclose(out.float(), expected, atol=1e-6, rtol=2 ** -7), (out.float() - expected).abs().max()


@needs_native
def test_native_decode_attention_takes_a_non_contiguous_query() -> None:
    layer_kv, tables = pool_and_tables([6, 3], BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    q_heads = torch.randn(2, KV_HEADS * GROUP + KV_HEADS, HEAD_DIM)[:, :KV_HEADS * GROUP]   # a split of q and k
    q_group = q_heads.view(2, KV_HEADS, GROUP, HEAD_DIM)
    out = paged_decode.decode_attention(q_group, layer_kv, tables, torch.tensor([6, 3]), 6)
    assert torch.allclose(out, reference(q_group, layer_kv, tables, [6, 3]), atol=1e-5, rtol=0)


@needs_native
def test_block_id_outside_the_pool_is_an_error_not_a_stray_read() -> None:
    layer_kv, tables = pool_and_tables([5], BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    tables[0, 1] = BLOCKS
    q_group = torch.randn(1, KV_HEADS, GROUP, HEAD_DIM)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode.decode_attention(q_group, layer_kv, tables, torch.tensor([5]), 5)


@needs_native
def test_context_longer_than_max_context_is_an_error_not_a_stray_write() -> None:
    layer_kv, tables = pool_and_tables([8], BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    q_group = torch.randn(1, KV_HEADS, GROUP, HEAD_DIM)
    with pytest.raises(ValueError, match="context length"):
        paged_decode.decode_attention(q_group, layer_kv, tables, torch.tensor([8]), 5)


@pytest.mark.parametrize("pool", [
    torch.zeros(1, 2, 4, 4, 2, 8),                           # head_dim not a multiple of 16
    torch.zeros(1, 2, 4, 4, 2, 32, dtype=torch.float16),     # fp32 and bf16 only
    torch.zeros(1, 2, 4, 4, 2, 32, device="meta"),           # CPU only
], ids=["head-dim-8", "float16", "meta"])
def test_native_path_stays_off_where_it_does_not_apply(pool: torch.Tensor) -> None:
    assert not paged_decode.applies(pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_path_applies_to_fp32_and_bf16_cpu_pools_when_built(dtype: torch.dtype) -> None:
    assert paged_decode.applies(torch.zeros(1, 2, 4, 4, 2, 32, dtype=dtype)) == paged_decode.NATIVE
