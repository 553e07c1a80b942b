"""oneDNN-packed linears: same numbers as F.linear, only where they apply, and the engine uses them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker import EngineConfig, LLMEngine, SamplingParams
from worker.model.checkpoint import save_checkpoint
from worker.model.layers.linear import Linear, can_pack, pack_linears
from worker.model.loader import load_model
from worker.model.model_config import ModelConfig
from worker.model.llama import LlamaForCausalLM

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")

# Every linear is packed, the 262 x 512 LM head too.
WIDE = dict(vocab_size=262, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, bos_token_id=256, eos_token_ids=[257])
PROMPTS = [[256] + list(range(40, 40 + 29)), [256, 104, 105], [256] + list(range(99, 99 + 17))]


def linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(in_features, out_features, bias=bias)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(512,), (0, 512), (1, 512), (8, 512), (300, 512), (3, 5, 512)])
@pytest.mark.parametrize("out_features", [1024, 40], ids=["wide", "small"])
def test_packed_linear_equals_f_linear(shape: tuple[int, ...], bias: bool, out_features: int) -> None:
    layer = linear(512, out_features, bias)
    plain_weight = layer.weight.detach().clone()
    x = torch.randn(*shape)
    expected = F.linear(x, plain_weight, layer.bias)
    assert layer.pack() and layer.packed
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == expected.shape == (*shape[:-1], out_features)
    assert torch.allclose(out, expected, atol=1e-5, rtol=0), (out - expected).abs().max()
    assert torch.equal(layer.weight.to_dense(), plain_weight)  # the packed copy holds the exact values


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_packed_bf16_linear_equals_f_linear_exactly(rows: int) -> None:
    layer = linear(512, 1024, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 512).to(torch.bfloat16)
    expected = F.linear(x, layer.weight.detach(), layer.bias)
    assert layer.pack() and layer.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)


@needs_onednn
def test_packed_linear_takes_non_contiguous_input() -> None:
    layer = linear(512, 1024, bias=False)
    x = torch.randn(512, 6).t()
    expected = F.linear(x, layer.weight.detach())
    layer.pack()
    with torch.inference_mode():
        assert torch.allclose(layer(x), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("weight", [
    torch.zeros(1024, 512, dtype=torch.float16),                     # fp32 and bf16 only
    torch.zeros(1024, 512, device="meta"),                           # CPU only
], ids=["float16", "meta"])
def test_pack_leaves_what_it_does_not_apply_to(weight: torch.Tensor) -> None:
    layer = Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    assert not can_pack(layer.weight)
    assert not layer.pack()
    assert not layer.packed and layer.weight.layout == torch.strided and layer.weight.requires_grad


@needs_onednn
def test_pack_is_idempotent_and_inference_only() -> None:
    layer = linear(512, 1024, bias=True)
    assert layer.pack() and not layer.pack()
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    assert layer.weight.shape == (1024, 512) and layer.weight.dtype == torch.float32


@needs_onednn
def test_tied_weight_is_copied_and_the_embedding_keeps_its_own() -> None:
    embed = nn.Embedding(1024, 256)
    nn.init.normal_(embed.weight, std=0.05)
    head = Linear(256, embed.num_embeddings, bias=False)
    head.weight = embed.weight
    before = embed.weight.detach().clone()
    hidden = torch.randn(4, 256)
    expected = F.linear(hidden, before)
    assert pack_linears(nn.ModuleList([embed, head])) == 1
    assert head.packed and embed.weight.layout == torch.strided and torch.equal(embed.weight, before)
    with torch.inference_mode():
        assert torch.allclose(head(hidden), expected, atol=1e-5, rtol=0)
        assert torch.equal(embed(torch.tensor([3, 7])), before[[3, 7]])


@pytest.fixture(scope="module", params=["llama", "qwen2-bias"])
def wide_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    bias = request.param == "qwen2-bias"
    config = ModelConfig(**WIDE, attention_bias=bias, model_type="qwen2" if bias else "llama",
                         tie_word_embeddings=bias)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(5)
    model.init_weights(generator)  # std 0.02, as the benchmark model
    with torch.no_grad():  # init_weights zeroes biases; give them values so the bias path counts
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1, generator=generator)
    path = tmp_path_factory.mktemp(request.param)
    save_checkpoint(model, path)
    return path


def engines(path: Path) -> tuple[LLMEngine, LLMEngine]:
    """Two engines on `path`: the normal one (linears packed) and one running the unpacked model."""
    made = [LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64)) for _ in range(2)]
    packed, plain = made
    plain.runner.model = load_model(path, plain.model_config, torch.float32)
    for engine, expected in ((packed, 4 * WIDE["num_hidden_layers"] + 1), (plain, 0)):
        assert sum(m.packed for m in engine.runner.model.modules() if isinstance(m, Linear)) == expected
    for engine in made:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return packed, plain


def prefill_logits(engine: LLMEngine) -> torch.Tensor:
    """Logits at every prompt position, from one batched prefill through the paged pool."""
    step = engine.scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in step.chunks] == [(0, len(p)) for p in PROMPTS]
    inputs = engine.runner.prepare(step)
    model = engine.runner.model
    with torch.inference_mode():
        return model.compute_logits(model(inputs.input_ids, inputs.positions, inputs.meta))


@needs_onednn
def test_packed_prefill_logits_equal_unpacked(wide_checkpoint: Path) -> None:
    packed, plain = engines(wide_checkpoint)
    ours, expected = prefill_logits(packed), prefill_logits(plain)
    assert ours.shape == (sum(map(len, PROMPTS)), WIDE["vocab_size"])
    assert torch.allclose(ours, expected, atol=1e-5, rtol=0), (ours - expected).abs().max()


@needs_onednn
def test_packed_decode_logits_equal_unpacked(wide_checkpoint: Path) -> None:
    made = engines(wide_checkpoint)
    for engine in made:
        engine.step()  # prefill
    for _ in range(5):  # crosses block boundaries (block_size 4)
        logits = []
        for engine in made:
            step = engine.scheduler.schedule()
            assert [c.num_tokens for c in step.chunks] == [1] * len(PROMPTS)
            logits.append((step.seqs, engine.runner.forward(engine.runner.prepare(step))))
        ours, expected = logits[0][1], logits[1][1]
        assert torch.allclose(ours, expected, atol=1e-5, rtol=0), (ours - expected).abs().max()
        for engine, (seqs, _) in zip(made, logits):
            engine.scheduler.postprocess(seqs, ours.argmax(-1).tolist())
