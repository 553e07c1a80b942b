"""The native prompt attention: SDPA's numbers in bf16 (within bf16 rounding; on AVX-512 and, where the CPU has
them, on AMX tiles) and in fp32, read from the paged pool."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.paged_pool import pool_and_tables
from worker.model.layers import prefill_native

needs_native_fp32 = pytest.mark.skipif(torch.float32 not in prefill_native.SUPPORTED,
                                       reason="_prefill_native is not built or this CPU lacks AVX-512")


def kernel(name: str, dtype: torch.dtype, lacks: str) -> object:
    runs = prefill_native._prefill_native is not None and prefill_native._prefill_native.supported(name)
    return pytest.param((name, dtype), id=name, marks=pytest.mark.skipif(
        not runs, reason=f"_prefill_native is not built or this CPU lacks {lacks}"))


@pytest.fixture(params=[kernel("bfloat16", torch.bfloat16, "AVX-512 BF16"), kernel("amx", torch.bfloat16, "AMX"),
                        kernel("float32", torch.float32, "AVX-512")])
def dtype(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    """Each kernel in turn, as what chunk_attention runs for its dtype."""
    name, dtype = request.param
    monkeypatch.setitem(prefill_native.KERNELS, dtype, name)
    return dtype


BLOCKS, BLOCK_SIZE = 160, 16


def reference(q: torch.Tensor, layer_kv: torch.Tensor, tables: torch.Tensor, lens: list[int],
              query_lens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Per sequence: its context copied out of the pool, then SDPA with a causal mask offset to the chunk."""
    rows, start = [], 0
    for table, ctx, n in zip(tables, lens, query_lens):
        kv = layer_kv[:, table].flatten(1, 2)[:, :ctx].transpose(1, 2).to(dtype)   # (2, kv_heads, ctx, d)
        visible = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
        q_heads = q[start:start + n].transpose(0, 1).unsqueeze(0).to(dtype)
        out = F.scaled_dot_product_attention(q_heads, kv[0:1], kv[1:2], attn_mask=visible, enable_gqa=True)
        rows.append(out[0].transpose(0, 1))
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("lens, query_lens, heads, kv_heads, head_dim", [
    ([1], [1], 8, 4, 64),                      # one token
    ([300], [300], 8, 4, 64),                  # a fresh prompt: plain causal
    ([700], [180], 8, 4, 64),                  # a chunk after its cached prefix
    ([37, 90, 5], [37, 20, 5], 6, 2, 32),      # ragged batch, group of 3
    ([200], [64], 4, 4, 128),                  # no GQA, wide heads
], ids=["one-token", "fresh", "prefixed", "ragged", "wide"])
def test_native_prefill_follows_sdpa(lens: list[int], query_lens: list[int], heads: int, kv_heads: int,
                                     head_dim: int, dtype: torch.dtype) -> None:
    layer_kv, tables = pool_and_tables(lens, BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = prefill_native.chunk_attention(q, layer_kv, tables, torch.tensor(lens), query_lens)
    exact = reference(q, layer_kv, tables, lens, query_lens, torch.float64)
    sdpa_error = (reference(q, layer_kv, tables, lens, query_lens, dtype).double() - exact).abs()
    assert out.dtype == dtype and out.shape == q.shape
    # bf16: output rounding (2**-9 of |out| <= ~3.5 here) bounds both; fp32: summation order, about 1e-6.
    floor = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert (out.double() - exact).abs().max() <= max(2 * sdpa_error.max().item(), floor)


def test_peaked_scores_subtract_the_largest_visible_one(dtype: torch.dtype) -> None:
    """Scores hundreds apart, as peaked attention has: each row's softmax must subtract the largest score it may
    see, or its powers overflow (a larger visible score missed) or all vanish (a masked one counted). Half the
    rows peak on a key every row of their block sees, half on their own key; every row scores a masked key twice
    as high still."""
    ctx, n, heads, kv_heads, d = 700, 180, 4, 2, 64
    layer_kv, tables = pool_and_tables([ctx], BLOCKS, BLOCK_SIZE, kv_heads, d, dtype=dtype)
    keys = layer_kv[0][tables[0]].flatten(0, 1)[:ctx].double()                # (ctx, kv_heads, d)
    first = ctx - n
    q = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        peak = first + i if i % 2 else i
        masked = min(first + i + 5, ctx - 1) if first + i + 5 < ctx else None
        for h in range(heads):
            q[i, h] = 20 * keys[peak, h * kv_heads // heads]
            if masked is not None:
                q[i, h] += 40 * keys[masked, h * kv_heads // heads]
    q = q.to(dtype)
    out = prefill_native.chunk_attention(q, layer_kv, tables, torch.tensor([ctx]), [n])
    exact = reference(q, layer_kv, tables, [ctx], [n], torch.float64)
    assert torch.isfinite(out).all()
    floor = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert (out.double() - exact).abs().max() <= max(floor * exact.abs().max().item(), floor)


def test_native_prefill_takes_the_query_as_a_split_view(dtype: torch.dtype) -> None:
    layer_kv, tables = pool_and_tables([50], BLOCKS, BLOCK_SIZE, 2, 64, dtype=dtype)
    qk = torch.randn(50, 4 + 2, 64).to(dtype)   # q and k heads rotated as one tensor, as the model does
    q = qk[:, :4]
    out = prefill_native.chunk_attention(q, layer_kv, tables, torch.tensor([50]), [50])
    assert torch.equal(out, prefill_native.chunk_attention(q.contiguous(), layer_kv, tables, torch.tensor([50]), [50]))


def test_block_id_outside_the_pool_is_an_error_not_a_stray_read(dtype: torch.dtype) -> None:
    layer_kv, tables = pool_and_tables([40], BLOCKS, BLOCK_SIZE, 2, 64, dtype=dtype)
    tables[0, 1] = BLOCKS
    with pytest.raises(ValueError, match="outside the pool"):
        prefill_native.chunk_attention(torch.randn(40, 4, 64).to(dtype), layer_kv, tables, torch.tensor([40]), [40])


@needs_native_fp32
def test_a_query_in_another_dtype_than_the_pool_is_refused() -> None:
    layer_kv, tables = pool_and_tables([40], BLOCKS, BLOCK_SIZE, 2, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="must both be bfloat16 or both float32"):
        prefill_native.chunk_attention(torch.randn(40, 4, 64).bfloat16(), layer_kv, tables, torch.tensor([40]), [40])


@pytest.mark.parametrize("pool", [
    torch.zeros(1, 2, 4, 4, 2, 16, dtype=torch.bfloat16),    # head_dim not a multiple of 32
    torch.zeros(1, 2, 4, 4, 2, 64, dtype=torch.float16),     # fp16: torch's attention, unchanged
    torch.zeros(1, 2, 4, 4, 2, 64, dtype=torch.bfloat16, device="meta"),   # CPU only
], ids=["head-dim-16", "float16", "meta"])
def test_native_path_stays_off_where_it_does_not_apply(pool: torch.Tensor) -> None:
    assert not prefill_native.applies(pool)


@pytest.mark.parametrize("threads", [2, 3])
def test_heads_split_across_threads_give_the_same_numbers(threads: int, dtype: torch.dtype) -> None:
    layer_kv, tables = pool_and_tables([120], BLOCKS, BLOCK_SIZE, 4, 64, dtype=dtype)
    q = torch.randn(120, 8, 64).to(dtype)
    one = prefill_native.chunk_attention(q, layer_kv, tables, torch.tensor([120]), [120])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        split = prefill_native.chunk_attention(q, layer_kv, tables, torch.tensor([120]), [120])
    finally:
        torch.set_num_threads(before)
    assert prefill_native.head_ranges(4, threads) == ([(0, 2), (2, 4)] if threads == 2 else [(0, 1), (1, 2), (2, 4)])
    assert torch.equal(split, one)


@needs_native_fp32
def test_a_kernel_this_module_does_not_have_is_refused() -> None:
    with pytest.raises(ValueError, match="no prompt attention kernel fp8 here"):
        prefill_native._prefill_native.prefill(0, 0, 0, 0, 0, 1, 1, 1, 32, 32, 1, 16, 1, 1, 1.0, 0, 1, "fp8")
