"""The built-in model, the benchmark model, the training script and non-fp32 dtypes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from worker import BUILTIN_MODEL_NAME, EngineConfig, LLMEngine, SamplingParams, create_bench_model
from worker.model.model_config import ModelConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_builtin_model_is_the_default_and_knows_python() -> None:
    eng = LLMEngine(EngineConfig(num_kv_blocks=64))
    assert eng.model_name == BUILTIN_MODEL_NAME and eng.max_model_len == 2048
    config = eng.model_config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads) == (256, 4, 4, 2)
    assert eng.kv_layout.num_kv_heads == 2 and eng.kv_layout.num_layers == 4
    # Cross-entropy on a stdlib source: uniform guessing would score ln(262) = 5.6 nats/byte.
    # The windows include long ones: the model was trained on 1024-byte contexts.
    source = Path(textwrap.__file__).read_text()
    for text in (source[5000:5250], source[5000:6000]):
        ids = eng.tokenizer.encode(text)
        with torch.inference_mode():
            model = eng.runner.model
            logits = model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0)))[0]
        loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
        assert loss < 2.0, (len(text), loss)
    prompt = eng.tokenizer.encode("import os\nimport sys\n\n\ndef main(")
    sampled = eng.generate([prompt], SamplingParams(max_tokens=64, temperature=0.7, seed=0))[0]
    out = eng.tokenizer.decode(sampled)
    assert all(c.isprintable() or c in "\n\t" for c in out) and sum(c.isalpha() for c in out) >= 16, out
    chat = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|bos|><|user|>hi\n<|assistant|>"


def test_served_model_name_defaults_to_the_dir_name(tiny_llama: Path) -> None:
    assert LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8)).model_name == tiny_llama.name
    named = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8, served_model_name="m"))
    assert named.model_name == "m"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engine_follows_fp32(tiny_llama: Path, dtype: str) -> None:
    half = LLMEngine(EngineConfig(model=str(tiny_llama), dtype=dtype, num_kv_blocks=64, block_size=4))
    assert half.kv_pool.dtype == getattr(torch, dtype)
    assert next(half.runner.model.parameters()).dtype == getattr(torch, dtype)
    full = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, block_size=4))
    prompt = [256, 104, 101, 108, 108, 111]
    # Low precision may diverge later; the first greedy tokens of a random model agree.
    assert half.generate([prompt], GREEDY)[0][:2] == full.generate([prompt], GREEDY)[0][:2]


def test_bench_model_is_deterministic_and_cached(tmp_path: Path) -> None:
    path = create_bench_model(tmp_path / "a")
    again = create_bench_model(tmp_path / "b")
    assert (path / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert create_bench_model(tmp_path / "a") == path
    config = ModelConfig.from_dir(path)
    assert (config.hidden_size, config.num_hidden_layers) == (512, 8)
    # A 2000-token prompt and its answer fit; a copy cached with another context is never picked up.
    assert config.max_position_embeddings == 4096 and path.name == "bench-llama-24m-ctx4k-seed0"
    eng = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=16))
    params = sum(p.numel() for p in eng.runner.model.parameters())
    assert 20e6 < params < 28e6
    assert len(eng.generate([[256, 65, 66]], GREEDY)[0]) == 12


def test_training_script_is_deterministic(tmp_path: Path) -> None:
    def train(out: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "scripts/train_builtin_model.py", "--out", str(out), "--steps", "2",
                                 "--batch", "2", "--seq-len", "16", "--corpus-bytes", "20000", "--threads", "1"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    runs = [train(tmp_path / "a"), train(tmp_path / "b")]   # one thread each: both at once
    try:
        for run in runs:
            output, _ = run.communicate(timeout=120)
            assert run.returncode == 0, output.decode(errors="replace")[-2000:]
    finally:
        for run in runs:
            run.kill()
            run.wait()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    eng = LLMEngine(EngineConfig(model=str(tmp_path / "a"), num_kv_blocks=8))
    assert eng.tokenizer.encode("ab") == [256, 97, 98]


def test_sliding_window_bounds_the_model_length(tiny_llama: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_llama, tmp_path / "mistral")
    config = json.loads((tmp_path / "mistral" / "config.json").read_text())
    config |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 64}
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(config))
    eng = LLMEngine(EngineConfig(model=str(tmp_path / "mistral"), num_kv_blocks=32))
    assert eng.max_model_len == 64
    with pytest.raises(ValueError, match="sliding_window 64"):
        LLMEngine(EngineConfig(model=str(tmp_path / "mistral"), num_kv_blocks=32, max_model_len=128))
