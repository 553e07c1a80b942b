"""Prompt attention in bf16 or fp32, read from the paged pool (_prefill_native.c): on AMX tiles for bf16 where
the CPU has them, else on AVX-512.

torch's CPU flash kernel runs bf16 no faster than fp32 on a CPU without AMX (one thread, the
benchmark model's shapes, 2000 causal tokens: ~64 ms a layer in either dtype), so attention
ate most of what bf16 gained in the linear layers; in fp32 it runs at under a third of what the
fp32 linear layers reach (half of a 2000-token fp32 prefill on the AMD EPYC machine). The native kernel multiplies bf16
pairs with fp32 accumulation (fp32 on FMAs), keeps scores, softmax and sums in fp32 as the flash
kernel does, and reads K and V through the block table (no gather, no mask). Results follow SDPA's
within the dtype's rounding. Where the CPU has AMX (Intel Xeon from Sapphire Rapids on) torch's flash kernel
runs its bf16 products on the tile unit, and so does the kernel's "amx" variant, with the same packing and
softmax as the AVX-512 one: one thread, the benchmark model's heads, one layer of a 2000-token prompt
10.5 ms against torch's 24 ms and 60 ms on AVX-512 BF16 (512 tokens: 1.2, 2.6 and 4.5 ms; the 2.1 GHz Xeon
machine). Without a C compiler or without AVX-512 (BF16, for bf16), `applies` is False and attention runs as
before; `KERNELS` says which variant runs each dtype here. With more than one torch thread, the KV heads
are split across threads (the kernel releases the GIL); each head's numbers are the same whatever the split.
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


def _kernel(dtype: torch.dtype) -> str | None:
    """The kernel that runs `dtype` on this CPU: bf16 on AMX tiles where they are, else on AVX-512."""
    name = str(dtype).removeprefix("torch.")
    for kernel in (["amx"] if dtype == torch.bfloat16 else []) + [name]:
        if _prefill_native is not None and _prefill_native.supported(kernel):
            return kernel
    return None


KERNELS = {dtype: kernel for dtype in _DTYPES if (kernel := _kernel(dtype)) is not None}
SUPPORTED = frozenset(KERNELS)   # the dtypes the kernel runs in on this CPU
NATIVE = SUPPORTED               # those whose prompt chunks use it (a profile may turn it off)
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
    kernel = KERNELS[q.dtype]
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
                _prefill_native.prefill(*args, *ranges[0], kernel)
            else:
                list(_threads(len(ranges)).map(lambda heads_range: _prefill_native.prefill(*args, *heads_range, kernel),
                                               ranges))
            row += n
    return out
