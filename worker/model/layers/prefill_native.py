"""Prompt attention on AVX-512, in bf16 or fp32, read from the paged pool (_prefill_native.c).

torch's CPU flash kernel runs bf16 no faster than fp32 on a CPU without AMX (one thread, the
benchmark model's shapes, 2000 causal tokens: ~64 ms a layer in either dtype), so attention
ate most of what bf16 gained in the linear layers; in fp32 it runs at under a third of what the
fp32 linear layers reach (half of a 2000-token fp32 prefill on the AMD EPYC machine). The native kernel multiplies bf16
pairs with fp32 accumulation (fp32 on FMAs), keeps scores, softmax and sums in fp32 as the flash
kernel does, and reads K and V through the block table (no gather, no mask). Results follow SDPA's
within the dtype's rounding. Without a C compiler or without AVX-512 (BF16, for bf16), `applies` is
False and attention runs as before. On a CPU with AMX, torch's flash kernel runs its bf16 matmuls on the
tile unit and is the faster one in bf16 (one thread, the benchmark model: a 2000-token prefill in
~400 ms against ~800 ms, 4000 tokens ~1.35 s against ~3.0 s, 8 prompts of 512 tokens 625 against 782
ms), so there the kernel runs fp32 only, where the tile unit does not help torch (not measured on such a
CPU; `NATIVE` says where it runs, `SUPPORTED` what it could run). With more
than one torch thread, the KV heads are split across threads (the kernel releases the GIL); each head's
numbers are the same whatever the split.
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch

try:
    from worker.model.layers import _prefill_native
except ImportError:  # built without a C compiler
    _prefill_native = None

_DTYPES = (torch.bfloat16, torch.float32)
# The dtypes the kernel can run in on this CPU, and those where it is the faster one (see above).
SUPPORTED = frozenset(dtype for dtype in _DTYPES
                      if _prefill_native is not None and _prefill_native.supported(str(dtype).removeprefix("torch.")))
_AMX = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
NATIVE = SUPPORTED - {torch.bfloat16} if _AMX else SUPPORTED
PAIR_LANES = 32  # head_dim must be a multiple of the kernel's bf16 vector width
PROFILER_NAME = "prefill_native::chunk_attention"   # what torch's profiler calls the kernel's calls


def applies(kv_pool: torch.Tensor) -> bool:
    """Whether prompt chunks over `kv_pool` can use the native kernel (a CPU pool in a dtype of NATIVE)."""
    return (kv_pool.dtype in NATIVE and kv_pool.device.type == "cpu"
            and kv_pool.is_contiguous() and kv_pool.shape[-1] % PAIR_LANES == 0)


@functools.cache
def _threads(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="prefill-native")


def head_ranges(kv_heads: int, threads: int) -> list[tuple[int, int]]:
    """KV heads split into at most `threads` contiguous, near-equal ranges."""
    parts = max(1, min(threads, kv_heads))
    return [(kv_heads * i // parts, kv_heads * (i + 1) // parts) for i in range(parts)]


def chunk_attention(q: torch.Tensor, layer_kv: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
    """Each sequence's chunk (its last query_lens[s] positions) attends causally over its context.

    q: (tokens, heads, d), the chunks' rows one sequence after another; layer_kv: one layer of
    the pool, (2, blocks, block_size, kv_heads, d), already holding the chunks' K and V;
    block_tables (seqs, max_blocks) and context_lens (seqs,) int64. Returns q's shape, contiguous.
    """
    assert _prefill_native is not None
    if q.dtype != layer_kv.dtype or q.dtype not in _DTYPES:
        raise ValueError(f"q ({q.dtype}) and the pool ({layer_kv.dtype}) must both be bfloat16 or both float32")
    heads, head_dim = q.shape[1:]
    fp32 = q.dtype == torch.float32
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    num_blocks, block_size, kv_heads = layer_kv.shape[1:4]
    tables = block_tables.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    ranges = head_ranges(kv_heads, torch.get_num_threads())
    row = 0
    with torch.profiler.record_function(PROFILER_NAME):
        for seq, (n, ctx) in enumerate(zip(query_lens, context_lens.tolist())):
            args = (q[row].data_ptr(), layer_kv[0].data_ptr(), layer_kv[1].data_ptr(), tables[seq].data_ptr(),
                    out[row].data_ptr(), n, heads, kv_heads, head_dim, q.stride(0), num_blocks, block_size,
                    tables.shape[1], ctx, head_dim ** -0.5)
            if len(ranges) == 1:
                _prefill_native.prefill(*args, *ranges[0], fp32)
            else:
                list(_threads(len(ranges)).map(lambda heads_range: _prefill_native.prefill(*args, *heads_range, fp32),
                                               ranges))
            row += n
    return out
