"""The shape of a KV pool, as both sides of a transfer must agree on it."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from transfer.errors import LayoutMismatch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


# How the pool's dimensions nest, outermost first: L layers, K the k/v pair, B blocks,
# T tokens of a block, H kv heads, D head_dim.
NEURON_ORDER = "LKBTHD"   # ours: one (layer, k/v) plane per block chunk
VLLM_CPU_ORDER = "LBHKTD"  # vLLM's CPU cache: a block holds, head by head, its K rows then its V rows
ORDERS = (NEURON_ORDER, VLLM_CPU_ORDER)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A paged KV pool: one contiguous tensor whose dimensions nest as `order` says.

    With the default order the shape is (layers, 2, blocks, block_size, kv_heads, head_dim)
    and block `b` is the slice `pool[:, :, b]`. Whatever the order, the pool is
    `num_planes` planes of `num_blocks` chunks of `plane_chunk_bytes`, block `b` being
    chunk `b` of every plane, so adjacent block ids are adjacent in memory within a plane.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    order: str = NEURON_ORDER

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        if self.order not in ORDERS:
            raise ValueError(f"unsupported KV order {self.order!r}; expected one of {ORDERS}")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        if self.order == VLLM_CPU_ORDER:
            return (self.num_layers, self.num_blocks, self.num_kv_heads, 2, self.block_size, self.head_dim)
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of the keys (or the values) of one block in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def num_planes(self) -> int:
        """Planes of the pool: per (layer, k/v) in our order, per layer in vLLM's."""
        return self.num_layers if self.order == VLLM_CPU_ORDER else 2 * self.num_layers

    @property
    def plane_chunk_bytes(self) -> int:
        """Bytes of one block within one plane."""
        return self.block_bytes // self.num_planes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers and both of k and v."""
        return 2 * self.num_layers * self.chunk_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        try:
            # A peer that predates `order` lays its pool out in ours.
            return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name != "order"},
                       order=data.get("order", NEURON_ORDER))
        except (KeyError, TypeError) as exc:
            raise LayoutMismatch(f"malformed KV layout {data!r}: {exc}") from exc

    def check_compatible(self, other: KVLayout) -> None:
        """Raises LayoutMismatch unless blocks of `other` can hold blocks of this layout.

        The number of blocks may differ; everything that shapes one block may not.
        """
        fields = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "order")
        diffs = [f"{f}: {getattr(self, f)} != {getattr(other, f)}" for f in fields
                 if getattr(self, f) != getattr(other, f)]
        if diffs:
            raise LayoutMismatch(f"incompatible KV layouts: ours {self.describe()}, peer's {other.describe()} ("
                                 + "; ".join(diffs) + ")")

    def describe(self) -> str:
        """One line naming everything that shapes a block, for error messages."""
        return (f"[{self.order} layers={self.num_layers} block_size={self.block_size} "
                f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} {self.dtype}]")
