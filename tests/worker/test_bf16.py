"""bfloat16: `--dtype auto` follows the CPU's flags, and bf16 logits follow transformers' in bf16 (prefill,
and decode through the paged bf16 cache) within bf16's tolerance."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.conftest import make_hf_checkpoint
from tests.worker.test_parity import PROMPTS, engine_for, hf_logits, prefill_logits
from worker import EngineConfig
from worker.dtype import auto_dtype, cpu_flags
from worker.model.layers import prefill_native
from worker.server.cli import parse_args

# Four of bf16's steps (8-bit mantissa: 2**-7 apart at the top of a binade) of each row's largest logit:
# logits near 0 carry absolute, not relative, rounding from the layers below. Where our kernels differ
# from HF's (masked attention of ragged batches) each layer rounds differently: ~2 steps measured, while
# transformers' own bf16 logits are up to ~10% of that scale from its fp32 ones. A prompt alone runs HF's
# kernels and formulas: exactly equal.
BF16_RTOL = 2.0 ** -5
CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx512f {}\n\nprocessor\t: 1\nflags\t\t: fpu\n"


@pytest.mark.parametrize("flag, dtype", [("avx512_bf16", "bfloat16"), ("amx_bf16", "bfloat16"),
                                         ("avx512_vnni", "float32")])
def test_auto_is_bf16_only_where_the_cpu_multiplies_bf16(flag: str, dtype: str) -> None:
    assert flag in cpu_flags(CPUINFO.format(flag))
    assert auto_dtype(CPUINFO.format(flag)) == dtype
    assert auto_dtype("") == "float32"


def test_dtype_flag_resolves_auto_and_defaults_to_float32() -> None:
    here = auto_dtype(Path("/proc/cpuinfo").read_text())
    assert parse_args(["--dtype", "auto"])[1].dtype == EngineConfig(dtype="auto").dtype == here
    assert parse_args([])[1].dtype == "float32"
    assert parse_args(["--dtype", "bfloat16"])[1].dtype == "bfloat16"
    with pytest.raises(ValueError, match="'auto' or one of"):
        EngineConfig(dtype="fp8")


def hf_bf16(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def assert_close_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().amax(dim=-1, keepdim=True)
    excess = (got - expected).abs() - BF16_RTOL * scale
    assert excess.max() <= 0, ((got - expected).abs().max(), scale.max())


@pytest.fixture(scope="module", params=["llama", "qwen2-wide-packed"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2-wide-packed":
        return make_hf_checkpoint(path, arch="qwen2", tie_word_embeddings=True, hidden_size=512,
                                  intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4)
    return make_hf_checkpoint(path)


@pytest.mark.parametrize("native", [False, True], ids=["torch-attention", "native-attention"])
def test_bf16_prefill_logits_follow_transformers_bf16(checkpoint: Path, native: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if native and torch.bfloat16 not in prefill_native.SUPPORTED:
        pytest.skip("worker.model.layers._prefill_native is not built or this CPU lacks AVX-512 BF16")
    monkeypatch.setattr(prefill_native, "NATIVE", frozenset({torch.bfloat16}) if native else frozenset())
    hf = hf_bf16(checkpoint)
    engine = engine_for(checkpoint, dtype="bfloat16")
    assert engine.kv_pool.dtype == torch.bfloat16
    for prompt, logits in zip(PROMPTS, prefill_logits(engine, PROMPTS)):   # ragged: masked attention
        assert logits.dtype == torch.float32
        assert_close_bf16(logits, hf_logits(hf, prompt))
    single = prefill_logits(engine_for(checkpoint, dtype="bfloat16"), PROMPTS[2:])[0]
    if native and prefill_native.applies(engine.kv_pool):   # our kernel rounds in its own order
        assert_close_bf16(single, hf_logits(hf, PROMPTS[2]))
    else:   # HF's own path: exact
        assert torch.equal(single, hf_logits(hf, PROMPTS[2]))


def test_bf16_decode_logits_through_the_paged_cache_follow_transformers_bf16(checkpoint: Path) -> None:
    hf = hf_bf16(checkpoint)
    engine = engine_for(checkpoint, dtype="bfloat16")
    prefill_logits(engine, PROMPTS)
    seqs = list(engine.scheduler.running)
    engine.scheduler.postprocess(seqs, [int(s.token_ids[-1]) % 200 + 30 for s in seqs])
    for _ in range(5):  # crosses block boundaries (block_size 4)
        step = engine.scheduler.schedule()
        logits = engine.runner.forward(engine.runner.prepare(step))
        for seq, row in zip(step.seqs, logits):
            assert_close_bf16(row, hf_logits(hf, seq.token_ids)[-1])
        engine.scheduler.postprocess(step.seqs, logits.argmax(-1).tolist())
