"""Paged attention over one shared KV pool.

Every step writes the new tokens' K/V into their slots of the pool first, then each sequence
attends over its whole context gathered through its block table (decodes on an fp32 CPU pool
read it through the table in place: see paged_decode; prompt chunks on a bf16 or fp32 pool with
AVX-512 likewise: see prefill_native). A step may mix decodes and prompt
chunks: each kind runs its own attention over its own rows. Because every layer writes before
it reads, a sequence may read blocks that another sequence of the same batch is filling in this
very step (prefix-cache hits on a block computed in the same prefill).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.layers import paged_decode, prefill_native

# torch's CPU flash kernel, which also returns each query's log-sum-exp (F.scaled_dot_product_attention
# does not): two partial attentions merge exactly with it. None where this torch lacks it.
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(slots=True)
class SeqGroup:
    """The sequences of one kind in a step (decodes, or prompt chunks) and what their attention reads."""

    block_tables: torch.Tensor         # (seqs, max_blocks), padded with block 0 (masked out)
    context_lens: torch.Tensor         # (seqs,) tokens in each context, this step's included
    max_context_len: int               # the longest of them
    mask: torch.Tensor | None          # (seqs, 1, max_query_len, max_blocks * block_size) additive;
                                       # None: fresh chunks of equal length (plain causal attention),
                                       # chunks that need none (see chunks_need_mask), or decodes on
                                       # the native path (see _decode_attention)
    query_index: torch.Tensor | None   # chunks: (tokens,) row in the padded (seqs * max_query_len)
                                       # layout; None for decodes and for fresh equal-length chunks
    query_lens: list[int]              # each sequence's new tokens this step

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by all layers; built once per step by the model runner.

    A step's tokens are its decodes' (one each) first, then its prompt chunks'.
    """

    kv_pool: torch.Tensor              # (layers, 2, blocks, block_size, kv_heads, head_dim)
    slot_mapping: torch.Tensor         # (tokens,) flat slot of each new token
    decodes: SeqGroup | None
    chunks: SeqGroup | None

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decodes is None else self.decodes.num_seqs


def build_mask(context_lens: torch.Tensor, query_lens: torch.Tensor, max_query_len: int,
               max_context: int, dtype: torch.dtype) -> torch.Tensor:
    """Key j is visible to query i of a sequence iff j < context_len and j <= i's position.

    Additive (0 / -inf) in the model dtype, so no layer converts it again. Padding query
    rows see the whole context so no row is fully masked (SDPA would give NaN).
    """
    key = torch.arange(max_context).view(1, 1, -1)
    q_pos = (context_lens - query_lens).view(-1, 1, 1) + torch.arange(max_query_len).view(1, -1, 1)
    visible = ((key <= q_pos) & (key < context_lens.view(-1, 1, 1))).unsqueeze(1)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


def chunks_need_mask(kv_pool: torch.Tensor, num_seqs: int) -> bool:
    """Whether prompt chunks that read a prefix (or differ in length) attend through an additive mask. Only the
    general path does: the native kernel reads each context through its table, and one chunk alone takes
    two unmasked flash passes (_prefixed_chunk_attention)."""
    return not prefill_native.applies(kv_pool) and (num_seqs > 1 or _FLASH_LSE is None)


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: (tokens, heads, d); k, v: (tokens, kv_heads, d). Returns (tokens, heads, d)."""
    k_cache, v_cache = meta.kv_pool[layer, 0], meta.kv_pool[layer, 1]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    n = meta.num_decode_tokens
    parts = []
    if meta.decodes is not None:
        parts.append(_decode_attention(meta.kv_pool[layer], q[:n], meta.decodes))
    if meta.chunks is not None:
        parts.append(_chunk_attention(meta.kv_pool[layer], q[n:], k[n:], v[n:], meta.chunks))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _chunk_attention(layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     group: SeqGroup) -> torch.Tensor:
    """Prompt chunks: each attends over its context so far (cached prefix, earlier chunks, itself)."""
    if prefill_native.applies(layer_kv):
        return prefill_native.chunk_attention(q, layer_kv, group.block_tables, group.context_lens, group.query_lens)
    if group.query_index is None:
        # Fresh chunks of equal length, nothing before them to read: attend over the new tokens themselves.
        n = group.num_seqs
        return causal_attention(_per_seq(q, n), _per_seq(k, n), _per_seq(v, n)).reshape(q.shape)
    if group.mask is None:
        return _prefixed_chunk_attention(layer_kv, q, k, v, group)   # one chunk: see chunks_need_mask
    keys, values = _gather(layer_kv, group.block_tables)
    num_seqs, max_query_len = group.num_seqs, group.mask.shape[2]
    q_pad = q.new_zeros(num_seqs * max_query_len, *q.shape[1:])
    q_pad[group.query_index] = q
    q_pad = q_pad.view(num_seqs, max_query_len, *q.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=group.mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(num_seqs * max_query_len, *q.shape[1:])[group.query_index]


def _prefixed_chunk_attention(layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              group: SeqGroup) -> torch.Tensor:
    """One prompt chunk after its cached prefix (a long prompt's second chunk on): the chunk attends to
    the prefix (every key visible) and to itself (causal) in two flash passes with no mask, merged by
    their log-sum-exps in fp32. The masked SDPA of the general path is ~1.7x slower in bf16 (its mask
    keeps it off the fast kernel); here nothing of size queries x keys is built."""
    prefix_len = group.max_context_len - q.shape[0]
    keys, values = _gather(layer_kv, group.block_tables[:, :-(-prefix_len // layer_kv.shape[2])])
    q_heads = q.transpose(0, 1).unsqueeze(0)   # (1, heads, n, d)
    before, lse_before = _FLASH_LSE(q_heads, keys[:, :, :prefix_len], values[:, :, :prefix_len])
    own, lse_own = _FLASH_LSE(q_heads, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), is_causal=True)
    top = torch.maximum(lse_before, lse_own)
    w_before, w_own = (lse_before - top).exp_(), (lse_own - top).exp_()
    total = w_before + w_own
    out = before.float().mul_((w_before / total).unsqueeze(-1)).add_(own.float().mul_((w_own / total).unsqueeze(-1)))
    return out[0].transpose(0, 1).to(q.dtype)


def _decode_attention(layer_kv: torch.Tensor, q: torch.Tensor, group: SeqGroup) -> torch.Tensor:
    """One new token per sequence: natively from the pool where that applies, else gather + SDPA.

    The query heads sharing a KV head become that head's queries (all at the same position,
    so the one mask row fits them all), which skips SDPA's GQA expansion. The native loops
    stop at each context's end and need no mask.
    """
    num_kv_heads, head_dim = layer_kv.shape[-2:]
    q_group = q.view(q.shape[0], num_kv_heads, -1, head_dim)     # (seqs, kv_heads, group, d)
    if group.mask is None:
        out = paged_decode.decode_attention(q_group, layer_kv, group.block_tables, group.context_lens,
                                            group.max_context_len)
    else:
        keys, values = _gather(layer_kv, group.block_tables)
        out = F.scaled_dot_product_attention(q_group, keys, values, attn_mask=group.mask)
    return out.reshape(q.shape)


def _per_seq(x: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """(seqs * len, heads, d) -> (seqs, len, heads, d) for equal-length sequences."""
    return x.view(num_seqs, -1, *x.shape[1:])


def _gather(layer_kv: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, blocks, block_size, kv_heads, d) gathered by table -> keys, values (seqs, kv_heads, ctx, d)."""
    num_seqs, max_blocks = block_tables.shape
    # index_select on the flat table is a plain row copy, much cheaper than advanced indexing;
    # one call for K and V together.
    blocks = layer_kv.index_select(1, block_tables.view(-1))
    kv = blocks.view(2, num_seqs, max_blocks * layer_kv.shape[2], *layer_kv.shape[3:]).transpose(2, 3)
    return kv[0], kv[1]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention without a cache (training): (batch, seq, heads, d) in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)
