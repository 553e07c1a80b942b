"""bf16 linear layers for the few rows of a decode step, on AMX tiles (_decode_linear.c).

torch's call into oneDNN costs ~20-30 us above the product itself, so a decode step of a small model spends
most of its linear time in calls: the built-in model's 17 linears per step took ~0.8 ms of a ~3 ms step at
batch 8 on the 2.1 GHz Xeon VM. The kernel runs oneDNN's AMX product for up to MAX_ROWS rows, in its order,
so results are the packed Linear's bit for bit; one thread, batch 8: 23 -> 6 us for a 256 x 256 weight,
44 -> 22 us for 1024 x 512, 202 -> 144 us for 2816 x 512 (weights in cache). Beyond 32 rows oneDNN changes
how it sums, and more rows amortise the call: those stay with oneDNN. The packed copy is kept beside oneDNN's,
only for weights up to `max_weight_bytes()`: 8 MiB on one torch thread (a weight of 32 MB takes ~3 ms to read
either way), 1 MiB on more, where oneDNN splits a larger weight across the threads and wins (2 threads, batch 8:
139 against 182 us for 2816 x 512; 36 against 53 us for 1024 x 512 still ours).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from worker.model.layers import _decode_linear
except ImportError:  # built without a C compiler
    _decode_linear = None

SUPPORTED = _decode_linear is not None and _decode_linear.supported()   # AMX here, and the kernel built
MAX_ROWS = 32
MAX_WEIGHT_BYTES = 8 << 20            # on one torch thread
MAX_WEIGHT_BYTES_THREADED = 1 << 20   # on more
BLOCK = 32    # outputs per packed block
K_TILE = 32   # inputs per tile


def max_weight_bytes() -> int:
    """The largest weight the kernel runs at torch's current thread count."""
    return MAX_WEIGHT_BYTES if torch.get_num_threads() == 1 else MAX_WEIGHT_BYTES_THREADED


def packs(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a layer of `weight` (out_features, in_features) and `bias` gets a packed copy: bf16 on the CPU,
    here, small enough, and any bias a contiguous bf16 vector the kernel can read."""
    return (SUPPORTED and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.layout == torch.strided and weight.numel() * weight.element_size() <= max_weight_bytes()
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in the kernel's layout: outputs padded to blocks of 32 and inputs to tiles of 32 (zeros), each
    block as (input pairs, 32 outputs, 2)."""
    out_features, in_features = weight.shape
    padded = F.pad(weight.detach(), (0, -in_features % K_TILE, 0, -out_features % BLOCK))
    return padded.view(-1, BLOCK, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


def applies(x: torch.Tensor, in_features: int) -> bool:
    """Whether the kernel takes input `x` to a layer of `in_features`: up to MAX_ROWS bf16 rows of that width,
    each contiguous, no autograd to record. (Any other width goes to oneDNN, which refuses it.)"""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] == in_features and x.dtype == torch.bfloat16
            and x.stride(1) == 1 and x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x W^T + bias, W packed by `pack`; x must pass `applies`."""
    out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    _decode_linear.run(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
                       x.shape[0], x.shape[1], out_features, x.stride(0), out.stride(0))
    return out
