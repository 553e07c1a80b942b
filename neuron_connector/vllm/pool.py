"""vLLM's per-layer KV tensors, moved onto one pool that our transfer engine registered.

vLLM's CPU backend gives each attention layer a tensor of shape
(num_blocks, num_kv_heads, block_size, 2 * head_dim): per block and head, the keys' rows
then the values' rows. `kv_layout` describes those tensors as one KVLayout in vLLM's
order; `rebind` points every layer tensor at its plane of the engine's pool (in shared
memory when the shm transport is used), so the model reads and writes the very memory
the transfer engine moves, with no copy and no serialization.
"""
from __future__ import annotations

import torch

from transfer import KVLayout
from transfer.layout import VLLM_CPU_ORDER

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def distinct_layers(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per cache, in memory order: layers that share a cache appear once."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in kv_caches.values():
        seen.setdefault(tensor.data_ptr(), tensor)
    return [seen[ptr] for ptr in sorted(seen)]


def kv_layout(layers: list[torch.Tensor]) -> KVLayout:
    """The KVLayout of vLLM's CPU caches; ValueError for any other shape."""
    if not layers:
        raise ValueError("vLLM registered no KV cache tensors")
    first = layers[0]
    for tensor in layers:
        if tensor.dim() != 4 or tuple(tensor.shape) != tuple(first.shape) or tensor.dtype != first.dtype:
            raise ValueError(f"NeuronConnector expects vLLM's CPU KV caches, every layer "
                             f"(num_blocks, num_kv_heads, block_size, 2 * head_dim) alike; got "
                             f"{[(tuple(t.shape), t.dtype) for t in layers]}")
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"vLLM's KV cache must be contiguous CPU tensors, got {tensor.device} "
                             f"contiguous={tensor.is_contiguous()}")
    if first.dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported KV cache dtype {first.dtype}; expected one of {list(_DTYPE_NAMES.values())}")
    num_blocks, num_kv_heads, block_size, width = first.shape
    return KVLayout(num_layers=len(layers), num_blocks=num_blocks, block_size=block_size,
                    num_kv_heads=num_kv_heads, head_dim=width // 2, dtype=_DTYPE_NAMES[first.dtype],
                    order=VLLM_CPU_ORDER)


@torch.no_grad()
def rebind(layers: list[torch.Tensor], pool: torch.Tensor) -> None:
    """Points layer i at plane i of `pool` (same bytes per block); its old memory is dropped."""
    if pool.shape[0] != len(layers) or pool[0].numel() != layers[0].numel():
        raise ValueError(f"pool {tuple(pool.shape)} does not hold {len(layers)} layers of "
                         f"{tuple(layers[0].shape)}")
    storage, base, per_layer = pool.untyped_storage(), pool.storage_offset(), pool[0].numel()
    for index, tensor in enumerate(layers):
        tensor.set_(storage, base + index * per_layer, tensor.shape, tensor.stride())
