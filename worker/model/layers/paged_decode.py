"""Decode attention read straight from the paged KV pool by a native loop (_paged_decode.c).

The torch path gathers each layer's contexts into a fresh tensor and SDPA reads that copy
again; the native loops read every K and V row once, from the pool (benchmark model, batch 8,
one thread, per layer inside a decode step: ~150 us instead of ~260 at 88 tokens of context,
~380 us instead of ~750 at 300). A bf16 pool is read as fp32, row by row: the query, scores,
softmax and sums stay fp32, and the output is rounded to bf16 once (an Intel Xeon with AMX, one layer,
one thread: 1.00 ms instead of 1.21 for 8 sequences at 650 tokens, 2.56 instead of 3.62 for 7 at 2000,
the same 0.40 ms for 8 at 150). With AVX-512 the loops run on vectors written out, and ask for the next
positions' rows ahead of use (this AMD EPYC, benchmark model, 8 sequences, a whole decode step's attention
inside the engine, against the plain loops: fp32 3.8 ms instead of 4.6 at 600 tokens of context, 12.2
instead of 13.4 at 2000; bf16 2.2 instead of 4.5 at 600, 6.9 instead of 14.1 at 2000). The extension
is compiled when the package is installed; without a C compiler `applies` is False and
attention gathers as before. Results equal SDPA's up to fp32 rounding.
"""
from __future__ import annotations

import torch

try:
    from worker.model.layers import _paged_decode
except ImportError:  # built without a C compiler
    _paged_decode = None

NATIVE = _paged_decode is not None
LANES = 16  # the native dot product's vector width: head_dim must be a multiple of it
POOL_DTYPES = (torch.float32, torch.bfloat16)


def applies(kv_pool: torch.Tensor) -> bool:
    """Whether decode steps over `kv_pool` can use the native loops (fp32 or bf16 CPU pool, built extension)."""
    return (NATIVE and kv_pool.device.type == "cpu" and kv_pool.dtype in POOL_DTYPES
            and kv_pool.is_contiguous() and kv_pool.shape[-1] % LANES == 0)


def decode_attention(q_group: torch.Tensor, layer_kv: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, max_context_len: int, portable: bool = False) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context.

    q_group: (seqs, kv_heads, group, d), the query heads that share a KV head grouped under
    it; layer_kv: one layer of the pool, (2, blocks, block_size, kv_heads, d); block_tables
    (seqs, max_blocks) and context_lens (seqs,) int64. Returns q_group's shape and dtype.
    `portable`: the kernel's plain loops even where its AVX-512 ones apply (what a CPU without it runs).
    """
    assert _paged_decode is not None
    dtype, bf16 = q_group.dtype, layer_kv.dtype == torch.bfloat16
    q_group = q_group.to(torch.float32).contiguous()
    num_seqs, kv_heads, group, head_dim = q_group.shape
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    dims = (num_seqs, tables.shape[1], layer_kv.shape[2], layer_kv.shape[1], kv_heads, group, head_dim,
            max_context_len)
    addresses = (tables.data_ptr(), lens.data_ptr())
    scores = q_group.new_empty(num_seqs, kv_heads, group, max_context_len)
    _paged_decode.scores(q_group.data_ptr(), layer_kv[0].data_ptr(), *addresses, scores.data_ptr(), *dims,
                         head_dim ** -0.5, bf16, portable)
    probs = torch.softmax(scores, dim=-1)
    out = torch.empty_like(q_group)
    _paged_decode.values(probs.data_ptr(), layer_kv[1].data_ptr(), *addresses, out.data_ptr(), *dims, 0.0, bf16,
                         portable)
    return out.to(dtype)
