"""The AMX decode linear: oneDNN's results bit for bit, only where it applies, and the packed Linear uses it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.layers import decode_linear
from worker.model.layers.linear import Linear

needs_amx = pytest.mark.skipif(not decode_linear.SUPPORTED, reason="no AMX here (or the kernel was not built)")


def bf16_linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    if bias:
        with torch.no_grad():
            layer.bias.normal_(0.0, 1.0)
    return layer


def onednn(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """What the packed Linear computes without the kernel: oneDNN's product."""
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")


@needs_amx
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("shape", [(256, 256), (262, 512), (1536, 256), (17, 6), (40, 100)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_equals_onednn_bit_for_bit(shape: tuple[int, int], rows: int, bias: bool) -> None:
    out_features, in_features = shape   # 262, 17, 40: partial blocks of outputs; 6, 100: partial tiles of inputs
    layer = bf16_linear(in_features, out_features, bias)
    assert layer.pack() and layer.decode_weight is not None
    x = torch.randn(rows, in_features).to(torch.bfloat16) * 4
    with torch.inference_mode():
        ours = layer(x)
        expected = onednn(layer, x)
    assert ours.shape == (rows, out_features) and ours.dtype == torch.bfloat16
    assert torch.equal(ours, expected), (ours.float() - expected.float()).abs().max()


@needs_amx
def test_reads_rows_through_their_stride() -> None:
    layer = bf16_linear(100, 64, bias=True)
    plain = layer.weight.detach().clone()
    wide = torch.randn(7, 160).to(torch.bfloat16)
    x = wide[:, 30:130]   # each row contiguous, 160 apart
    layer.pack()
    with torch.inference_mode():
        assert decode_linear.applies(x, 100)
        assert torch.equal(layer(x), F.linear(x.contiguous(), plain, layer.bias))


@needs_amx
def test_applies_to_few_contiguous_bf16_rows_only() -> None:
    x = torch.zeros(decode_linear.MAX_ROWS, 64, dtype=torch.bfloat16)
    assert decode_linear.applies(x, 64) and decode_linear.applies(x[:0], 64)
    assert not decode_linear.applies(torch.zeros(decode_linear.MAX_ROWS + 1, 64, dtype=torch.bfloat16), 64)
    assert not decode_linear.applies(x, 65)                      # another layer's width
    assert not decode_linear.applies(x.float(), 64)
    assert not decode_linear.applies(x.view(2, -1, 64), 64)      # the engine's inputs are (tokens, features)
    assert not decode_linear.applies(torch.zeros(64, 8, dtype=torch.bfloat16).t(), 64)   # rows not contiguous
    assert not decode_linear.applies(x.clone().requires_grad_(), 64)   # autograd would record nothing


@needs_amx
def test_no_rows_and_a_wrong_width() -> None:
    layer = bf16_linear(64, 96, bias=True)
    layer.pack()
    with torch.inference_mode():
        assert layer(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 96)
        with pytest.raises(RuntimeError):   # oneDNN's refusal, not a read past the weight
            layer(torch.zeros(4, 65, dtype=torch.bfloat16))


@needs_amx
@pytest.mark.parametrize("rows", [decode_linear.MAX_ROWS + 1, 100])
def test_more_rows_run_on_onednn(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = bf16_linear(256, 256, bias=False)
    layer.pack()
    monkeypatch.setattr(decode_linear, "linear", lambda *args: pytest.fail("the kernel ran"))
    x = torch.randn(rows, 256).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), onednn(layer, x))


@pytest.mark.parametrize("case", ["float32", "large", "no-amx", "float32-bias"])
def test_no_packed_copy_where_it_does_not_apply(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = bf16_linear(256, 256, bias=case == "float32-bias")
    if case == "float32":
        layer = layer.float()
    elif case == "float32-bias":
        layer.bias = torch.nn.Parameter(layer.bias.float())
    elif case == "large":
        monkeypatch.setattr(decode_linear, "MAX_WEIGHT_BYTES", 256 * 256 * 2 - 1)
    else:
        monkeypatch.setattr(decode_linear, "SUPPORTED", False)
    layer.pack()
    assert layer.decode_weight is None


@needs_amx
def test_more_threads_keep_larger_weights_on_onednn() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert decode_linear.max_weight_bytes() == decode_linear.MAX_WEIGHT_BYTES
        torch.set_num_threads(2)
        assert decode_linear.max_weight_bytes() == decode_linear.MAX_WEIGHT_BYTES_THREADED
        small, large = bf16_linear(512, 1024, bias=False), bf16_linear(512, 1025, bias=False)   # 1 MiB, just over
        small.pack(), large.pack()
        assert small.decode_weight is not None and large.decode_weight is None
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_pack_layout() -> None:
    weight = torch.arange(40 * 6, dtype=torch.float32).view(40, 6).to(torch.bfloat16)
    packed = decode_linear.pack(weight)
    assert packed.shape == (2, 16, 32, 2)   # 40 outputs -> 2 blocks of 32; 6 inputs -> one tile of 16 pairs
    assert torch.equal(packed[0, 1, 3], weight[3, 2:4])        # block 0, pair 1 (inputs 2, 3), output 3
    assert torch.equal(packed[1, 2, 7], weight[39, 4:6])       # block 1, output 32 + 7
    assert not packed[1, :, 8:].any() and not packed[:, 3:].any()   # padding is zeros


@needs_amx
def test_run_refuses_bad_shapes() -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    packed = decode_linear.pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    out = torch.empty(2, 32, dtype=torch.bfloat16)
    for rows, in_features, out_features, x_stride in ((-1, 64, 32, 64), (2, 0, 32, 64), (2, 64, 0, 64),
                                                      (2, 64, 32, 63)):
        with pytest.raises(ValueError, match="features positive"):
            decode_linear._decode_linear.run(x.data_ptr(), packed.data_ptr(), 0, out.data_ptr(), rows, in_features,
                                             out_features, x_stride, 32)
