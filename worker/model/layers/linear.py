"""A Linear layer whose weight can be pre-packed for oneDNN, for faster CPU inference.

Decode multiplies a few rows by every weight of the model, so it is bound by reading the
weights. F.linear (MKL sgemm) does that at about half the memory bandwidth for a batch of 8;
oneDNN, with the weight reordered once into its blocked layout, runs close to the bandwidth
floor (the benchmark model's decoder linears, batch 8, one thread: 12.3 ms -> 6.6 ms per
step) and is also faster for prefill-sized inputs. Results equal F.linear's up to fp32
rounding; bf16 ones equal F.linear's exactly (both run oneDNN's bf16 kernels, fp32 accumulation),
packed about 1.5-2x faster for 1 to 8 rows. Where the CPU has AMX, bf16 inputs of up to 32 rows skip torch's
call into oneDNN, most of a small layer's time, for the same product in decode_linear (same results, bit for bit).

Small weights are packed too. One thread, the AMD EPYC machine, the built-in model's 256 x 256 to 1536 x 256
weights: packed runs 2.0-2.3x as fast as F.linear at fp32 for 128 or 512 rows, and as fast or faster for 8;
only a single fp32 row runs 4-8 us slower (F.linear's plain loop over a weight in cache). In bf16 packed is
faster at every size and row count measured (1 to 512 rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.layers import decode_linear

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Packing applies to plain fp32 or bf16 CPU weights, with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.layout == torch.strided
            and torch.backends.mkldnn.is_available())


class Linear(nn.Linear):
    """nn.Linear (same parameters, same training behaviour) plus an inference-only `pack()`."""

    decode_weight: torch.Tensor | None = None   # the weight packed for decode_linear, by pack() where that applies

    @property
    def packed(self) -> bool:
        return self.weight.is_mkldnn

    @torch.no_grad()
    def pack(self) -> bool:
        """Replaces the weight by its oneDNN-packed copy; False (and no change) where it does not apply.

        The packed weight keeps shape, dtype and numel but has no autograd and no plain
        storage: pack only a model that will only run inference on the CPU from now on.
        """
        if not can_pack(self.weight):
            return False
        if decode_linear.packs(self.weight, self.bias):
            self.decode_weight = decode_linear.pack(self.weight)
        # No batch-size hint: measured as fast as the best hint for 1 to 64 rows.
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self.weight = nn.Parameter(packed, requires_grad=False)
        if self.bias is not None:
            self.bias.requires_grad_(False)  # the packed op has no autograd: make that explicit
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode_weight is not None and decode_linear.applies(x, self.in_features):
            return decode_linear.linear(x, self.decode_weight, self.bias, self.out_features)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Packs every Linear of `model` (see Linear.pack); returns how many were packed.

    A weight tied to another module (the LM head to the embedding) is copied into the
    packed layout and the other module keeps the plain one, so the tie no longer holds.
    """
    return sum(module.pack() for module in model.modules() if isinstance(module, Linear))
