"""Our model against transformers on the same checkpoint: logits and greedy generations."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.conftest import make_hf_checkpoint
from worker import EngineConfig, LLMEngine, SamplingParams
from worker.model import runner
from worker.model.layers import paged_decode
from worker.model.layers.attention import chunks_need_mask

# fp32 sums in another order (the engine's oneDNN-packed linears, transformers' GEMMs) differ by a few ulps each:
# up to 1.3e-4 on the wide model's logits (magnitude 10) on an Intel Xeon with AMX, under 1e-4 on an AMD EPYC.
CLOSE = {"atol": 2e-4, "rtol": 0}
PROMPTS = [[256, 100, 101, 102, 32, 120, 40, 41, 58, 10, 32, 32],
           [256, 105, 109, 112, 111, 114, 116],
           [256] + list(range(33, 33 + 37))]


def hf_model(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def engine_for(path: Path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=128, **kwargs))


def prefill_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every prompt position, computed by one batched prefill through the paged pool."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    step = engine.scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in step.chunks] == [(0, len(p)) for p in prompts]
    inputs = engine.runner.prepare(step)
    with torch.inference_mode():
        hidden = engine.runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = engine.runner.model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


@pytest.fixture(scope="module", params=["llama", "llama3-rope", "qwen2-bias", "qwen2-wide-packed"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2-wide-packed":  # wide enough that the engine packs its linears for oneDNN
        return make_hf_checkpoint(path, arch="qwen2", tie_word_embeddings=True, hidden_size=512,
                                  intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4)
    if request.param == "llama3-rope":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}
        return make_hf_checkpoint(path, rope_scaling=scaling, rope_theta=500000.0)
    if request.param == "qwen2-bias":
        return make_hf_checkpoint(path, arch="qwen2", tie_word_embeddings=True)
    return make_hf_checkpoint(path)


@pytest.mark.parametrize("batch", [PROMPTS, PROMPTS[2:], [PROMPTS[0], PROMPTS[0][::-1]]],
                         ids=["ragged", "single", "equal-lengths"])
def test_prefill_logits_match_transformers(checkpoint: Path, batch: list[list[int]]) -> None:
    hf = hf_model(checkpoint)
    ours = prefill_logits(engine_for(checkpoint), batch)
    for prompt, logits in zip(batch, ours):
        expected = hf_logits(hf, prompt)
        assert logits.shape == expected.shape
        assert torch.allclose(logits, expected, **CLOSE), (logits - expected).abs().max()


@pytest.mark.parametrize("native", [True, False], ids=["native", "gather-sdpa"])
@pytest.mark.parametrize("batch", [PROMPTS, [PROMPTS[0], PROMPTS[0][::-1]]], ids=["ragged", "equal-lengths"])
def test_decode_logits_through_paged_cache_match_transformers(checkpoint: Path, batch: list[list[int]], native: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not paged_decode.NATIVE:
        pytest.skip("worker.model.layers._paged_decode is not built")
    monkeypatch.setattr(paged_decode, "NATIVE", native)
    hf = hf_model(checkpoint)
    engine = engine_for(checkpoint)
    prefill_logits(engine, batch)
    seqs = list(engine.scheduler.running)
    engine.scheduler.postprocess(seqs, [int(s.token_ids[-1]) % 200 + 30 for s in seqs])
    for _ in range(6):  # crosses block boundaries (block_size 4)
        step = engine.scheduler.schedule()
        seqs = step.seqs
        assert [c.num_tokens for c in step.chunks] == [1] * len(batch)
        inputs = engine.runner.prepare(step)
        assert inputs.meta.decodes is not None and inputs.meta.chunks is None
        assert (inputs.meta.decodes.mask is None) == native  # the native loops stop at each context's end
        logits = engine.runner.forward(inputs)
        for seq, row in zip(seqs, logits):
            expected = hf_logits(hf, seq.token_ids)[-1]
            assert torch.allclose(row, expected, **CLOSE), (row - expected).abs().max()
        engine.scheduler.postprocess(seqs, logits.argmax(-1).tolist())


@pytest.mark.parametrize("budget", [5, 16], ids=["tiny-chunks", "block-chunks"])
def test_chunked_steps_logits_match_transformers(checkpoint: Path, budget: int) -> None:
    """Steps mixing decodes with prompt chunks that start mid-block give transformers' logits at every row."""
    hf = hf_model(checkpoint)
    engine = engine_for(checkpoint, enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=4,
                        short_prompt_tokens=0)   # every step mixed
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    mixed = False
    while not engine.scheduler.is_finished():
        step = engine.scheduler.schedule()
        assert step.num_tokens <= budget
        mixed = mixed or len({c.num_tokens > 1 for c in step.chunks}) == 2
        inputs = engine.runner.prepare(step)
        if (chunks := inputs.meta.chunks) is not None and chunks.query_index is not None:
            assert (chunks.mask is not None) == chunks_need_mask(engine.runner.kv_pool, chunks.num_seqs)
        with torch.inference_mode():
            logits = engine.runner.model.compute_logits(
                engine.runner.model(inputs.input_ids, inputs.positions, inputs.meta))
        rows = logits.split([c.num_tokens for c in step.chunks])
        for chunk, got in zip(step.chunks, rows):
            end = chunk.start + chunk.num_tokens
            expected = hf_logits(hf, chunk.seq.token_ids[:end])[chunk.start:end]
            assert torch.allclose(got, expected, **CLOSE), (chunk, (got - expected).abs().max())
        sampled = step.sampled
        last = [rows[i][-1] for i, c in enumerate(step.chunks) if c.samples]
        engine.scheduler.postprocess(sampled, [int(r.argmax()) for r in last])
    assert mixed  # some step held decodes and a prompt chunk together


def test_greedy_generation_matches_transformers_token_for_token(checkpoint: Path) -> None:
    hf = hf_model(checkpoint)
    engine = engine_for(checkpoint)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = engine.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out == ref
    assert engine.stats().num_blocks_used == 0


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    import transformers

    single = make_hf_checkpoint(tmp_path / "single")
    model = transformers.AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "sharded" / name).write_bytes((single / name).read_bytes())
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert engine_for(tmp_path / "sharded").generate(PROMPTS, params) == engine_for(single).generate(PROMPTS, params)


def test_checkpoints_we_save_load_in_transformers(tmp_path: Path) -> None:
    from worker.model.checkpoint import save_checkpoint
    from worker.model.model_config import ModelConfig
    from worker.model.llama import LlamaForCausalLM

    config = ModelConfig(vocab_size=262, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         bos_token_id=256, eos_token_ids=[257])
    ours = LlamaForCausalLM(config)
    ours.init_weights(torch.Generator().manual_seed(3), std=0.2)
    save_checkpoint(ours, tmp_path)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        expected = ours.compute_logits(ours(ids, torch.arange(ids.shape[1]).unsqueeze(0)))[0]
    assert torch.allclose(hf_logits(hf_model(tmp_path), PROMPTS[2]), expected, **CLOSE)


def test_logprobs_and_prompt_logprobs_match_transformers(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each output token's logprob and top alternatives, and every prompt token's, are log-softmax of
    transformers' logits on the same sequence (greedy, so the tokens are transformers' too)."""
    monkeypatch.setattr(runner, "PROMPT_LOGITS_ROWS", 5)   # the prompt's logits made five rows at a time
    hf = hf_model(checkpoint)
    engine = engine_for(checkpoint)
    engine.add_request("lp", PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3,
                                                         prompt_logprobs=2))
    outputs = []
    while not (outputs and outputs[-1].finished):
        outputs += engine.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    expected = torch.log_softmax(hf_logits(hf, PROMPTS[0] + tokens), dim=-1)
    prompt_entries = outputs[0].prompt_logprobs
    assert prompt_entries[0] is None and len(prompt_entries) == len(PROMPTS[0])
    entries = [(p, e) for p, e in enumerate(prompt_entries[1:])] + \
              [(len(PROMPTS[0]) - 1 + i, o.logprobs[0]) for i, o in enumerate(outputs)]
    for position, entry in entries:   # position's logits give the next token's entry
        row = expected[position]
        mine = float(row[entry.token_id])
        assert entry.logprob == pytest.approx(mine, abs=1e-4)
        assert int((row > mine + 1e-4).sum()) < entry.rank <= int((row >= mine - 1e-4).sum())
        assert [t for t, _ in entry.top] == row.topk(len(entry.top)).indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(row.topk(len(entry.top)).values.tolist(), abs=1e-4)
