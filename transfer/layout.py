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


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A paged KV pool: one tensor of shape (layers, 2, blocks, block_size, kv_heads, head_dim).

    Block `b` of the pool is the slice `pool[:, :, b]`: 2 * num_layers chunks of
    `chunk_bytes` each, one per (layer, k/v), so adjacent block ids are adjacent in memory
    within every chunk.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
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
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one block within one (layer, k/v) plane."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

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
            return cls(**{name: data[name] for name in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise LayoutMismatch(f"malformed KV layout {data!r}: {exc}") from exc

    def check_compatible(self, other: KVLayout) -> None:
        """Raises LayoutMismatch unless blocks of `other` can hold blocks of this layout.

        The number of blocks may differ; everything that shapes one block may not.
        """
        fields = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
        diffs = [f"{f}: {getattr(self, f)} != {getattr(other, f)}" for f in fields
                 if getattr(self, f) != getattr(other, f)]
        if diffs:
            raise LayoutMismatch("incompatible KV layouts (" + "; ".join(diffs) + ")")
