"""The native element-wise steps: torch's op sequence's numbers (bf16 to the bit but where an fp32 intermediate
straddles a rounding boundary; fp32 within a few ulps), on strided rows and ragged widths, and torch's own ops
wherever the kernel does not apply."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from worker.model.layers import pointwise

DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch."), marks=pytest.mark.skipif(
    dtype not in pointwise.SUPPORTED, reason=f"_pointwise is not built or this CPU cannot run it in {dtype}"))
    for dtype in (torch.bfloat16, torch.float32)]


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), -1) * signed_sin


def assert_like_torch(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if ours.dtype == torch.bfloat16:
        # At most one element in a thousand one bf16 step away (2**-7 of its size); the rest equal.
        off = ours != theirs
        assert off.float().mean() <= 1e-3
        assert ((ours.float() - theirs.float()).abs()[off] <= theirs.float().abs()[off] * 2.0 ** -7).all()
    else:
        torch.testing.assert_close(ours, theirs, rtol=4 * 2.0 ** -23, atol=1e-30)


def rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, intermediate", [(1, 1408), (37, 1408), (512, 1408), (5, 40)])
def test_silu_mul_follows_torch(tokens: int, intermediate: int, dtype: torch.dtype) -> None:
    # Wide enough that silu saturates both ways (to 0 below about -88 and to x above).
    gate_up = rows((tokens, 2 * intermediate), dtype, seed=tokens, scale=30)
    assert_like_torch(pointwise.silu_mul(gate_up), torch_silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 512), (300, 512), (7, 40)])
def test_rms_norm_follows_torch_on_strided_rows(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    x = rows((tokens, 2 * hidden), dtype, seed=tokens)[:, :hidden]   # rows twice their width apart
    weight = rows((hidden,), dtype, seed=1)
    assert_like_torch(pointwise.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 12, 64), (200, 12, 64), (9, 3, 24), (4, 2, 128)])
def test_rotary_is_torch_to_the_bit(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Each product rounded before the sum, as torch's separate ops round them: no fused multiply-add."""
    qkv = rows((tokens, (heads + 2) * head_dim), dtype, seed=tokens)
    x = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)     # q and k heads: a view of the fused output
    angle = torch.rand(tokens, 1, head_dim, generator=torch.Generator().manual_seed(2)) * 6
    sign = torch.ones(head_dim)
    sign[:head_dim // 2] = -1
    cos, signed_sin = angle.cos().to(dtype), (angle.sin() * sign).to(dtype)
    assert torch.equal(pointwise.rotary(x, cos, signed_sin), torch_rotary(x, cos, signed_sin))


@pytest.mark.parametrize("step, args", [
    ("silu_mul", lambda t: (t,)),
    ("rms_norm", lambda t: (t, torch.ones(t.shape[-1], dtype=t.dtype), 1e-5)),
], ids=["silu_mul", "rms_norm"])
@pytest.mark.parametrize("case", ["float16", "grad", "3-d"])
def test_torch_runs_the_step_where_the_kernel_does_not_apply(step: str, args: Callable, case: str) -> None:
    x = rows((2, 3, 64) if case == "3-d" else (6, 64), torch.float16 if case == "float16" else torch.float32, 0)
    x.requires_grad_(case == "grad")
    out = getattr(pointwise, step)(*args(x))
    reference = torch_silu_mul(x) if step == "silu_mul" else torch_rms_norm(*args(x))
    torch.testing.assert_close(out, reference)
    if case == "grad":   # training: the torch ops carry the gradient
        out.sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_runs_for_parameters_where_autograd_records_nothing(dtype: torch.dtype, monkeypatch) -> None:
    """A model's weights require grad; under inference_mode (the engine) the kernel takes them, with grad enabled
    and a tracked tensor (training) torch's ops run."""
    calls: list[str] = []
    native = pointwise._pointwise.rms_norm
    monkeypatch.setattr(pointwise._pointwise, "rms_norm", lambda *args: (calls.append("native"), native(*args))[1])
    weight = torch.nn.Parameter(rows((64,), dtype, seed=1))
    x = rows((3, 64), dtype, seed=2)
    with torch.inference_mode():
        pointwise.rms_norm(x, weight, 1e-5)
    assert calls == ["native"]
    pointwise.rms_norm(x, weight, 1e-5).sum().backward()
    assert calls == ["native"] and weight.grad is not None
